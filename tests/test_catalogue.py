"""Every catalogue model is registered and passes the generic checks."""

import pkgutil

import pytest
import structattn.models
import torch

import structattn as sa

from .registry import CASES


def test_every_model_module_is_registered():
    modules = {m.name for m in pkgutil.iter_modules(structattn.models.__path__)
               if not m.name.startswith("_")}
    assert modules == set(sa.models.REGISTRY), (
        "each file in models/ must register its factory in structattn.models.REGISTRY")
    assert set(CASES) == set(sa.models.REGISTRY), (
        "each registered model needs a case in tests/registry.py")


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_equals_pyro_enumeration(name):
    model, inputs = CASES[name]()
    report = sa.inference.compare(model, *inputs)
    assert report.max_abs_diff < 1e-6, str(report)


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradcheck_inputs_and_every_parameter(name):
    model, inputs = CASES[name]()
    layer = sa.compile(model)
    smooth = [i for i, x in enumerate(inputs) if x.is_floating_point()]
    diff_inputs = tuple(inputs[i].detach().requires_grad_() for i in smooth)
    names = [n for n, _ in layer.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for p in layer.parameters())

    def f(*args):
        ins = list(inputs)  # integer inputs (edge lists) stay fixed
        for i, x in zip(smooth, args[:len(smooth)], strict=True):
            ins[i] = x
        ps = args[len(smooth):]
        return torch.func.functional_call(layer, dict(zip(names, ps, strict=True)), tuple(ins))

    assert torch.autograd.gradcheck(f, diff_inputs + params)


@pytest.mark.parametrize("name", sorted(CASES))
def test_nan_input_is_refused(name):
    model, inputs = CASES[name]()
    bad = inputs[0].clone()
    bad[..., 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"node set .* non-finite"):
        sa.compile(model)(bad, *inputs[1:])


@pytest.mark.parametrize("name", sorted(CASES))
def test_factory_is_documented(name):
    factory = sa.models.REGISTRY[name]
    model, _ = CASES[name]()
    assert factory.__doc__ and type(model).__doc__.count("φ") >= 1
