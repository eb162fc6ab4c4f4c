"""Every catalogue model is registered and passes the generic checks.

The cases come from tests/registry.py, derived from ``structattn.models.CATALOGUE``: each
model's default configuration, and the variants it names (expanding attention's default is
mean field, an approximation, so its exact variant is what meets Pyro to 1e-6).
"""

import os
import pathlib
import pkgutil
import re

import pytest
import torch

import structattn as sa
import structattn.models

from .registry import CASES, EXACT

APPROXIMATE = sorted(k for k, c in CASES.items() if not c.exact)


def test_every_model_module_is_registered():
    modules = {m.name for m in pkgutil.iter_modules(structattn.models.__path__)
               if not m.name.startswith("_")}
    assert modules == set(sa.models.REGISTRY), (
        "each file in models/ must be listed in models/__init__.py "
        "(one line; see the README's 'Adding a catalogue model')")
    assert {c.model for c in CASES.values()} == set(sa.models.REGISTRY), (
        "each registered model needs a case (its ENTRY in models/NAME.py)")
    assert set(sa.models.EXAMPLES) == set(sa.models.REGISTRY)


@pytest.mark.parametrize("name", sorted(sa.models.CATALOGUE))
def test_entry_states_one_model(name):
    """A model's ENTRY: its factory is the public name, its class is exported, its example
    and its case build that class, and the example draws (``example_inputs``)."""
    entry = sa.models.CATALOGUE[name]
    assert getattr(sa.models, name) is entry.factory is sa.models.REGISTRY[name]
    assert getattr(sa.models, entry.declaration.__name__) is entry.declaration
    assert entry.exact or entry.variants, f"{name}: an approximate default names exact variants"
    example = entry.factory(**sa.models.EXAMPLES[name])
    assert type(example) is entry.declaration
    assert all(isinstance(x, torch.Tensor) for x in example.example_inputs())
    model, inputs = entry.case()
    assert type(model) is entry.declaration
    assert all(isinstance(x, torch.Tensor) for x in inputs)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert all(x.dtype == torch.float64 for x in inputs if x.is_floating_point())


@pytest.mark.parametrize("name", EXACT)
def test_compiled_equals_pyro_enumeration(name):
    model, inputs = CASES[name]()
    report = sa.inference.compare(model, *inputs)
    assert report.max_abs_diff < 1e-6, str(report)


@pytest.mark.parametrize("name", APPROXIMATE)
def test_approximate_reading_is_a_posterior_on_the_support(name):
    """An approximate default (mean field): not Pyro's posterior, but a distribution over each
    child's support in Pyro's reading, and the layer's output is its expectation of the value;
    an exact variant of the same model meets Pyro (above)."""
    assert any(c.model == CASES[name].model and c.exact for c in CASES.values())
    model, inputs = CASES[name]()
    layer = sa.compile(model)
    out, post = layer(*inputs, return_posterior=True)
    posts = post if isinstance(post, dict) else {next(iter(sa.trace_structure(
        model.model, *inputs).families)): post}
    truth = sa.inference.exact(model, *inputs)
    for fam, p in posts.items():
        exact = truth.marginals[fam].detach()
        assert p.shape == exact.shape and bool((p >= 0).all())
        mass = p.sum(-1)
        assert torch.allclose(mass, exact.sum(-1), atol=1e-12)  # 1, or 0 without a parent
        assert bool((p[exact == 0] == 0).all()), "mass outside the support"
    torch.testing.assert_close(out, layer(*inputs))
    assert bool(torch.isfinite(out).all())


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
    declared = "|".join(map(re.escape, sa.trace_structure(model.model, *inputs).node_sets))
    # named as its node set, or — where the node set is built from a transformed argument — as
    # the argument itself, at the entry's index in the argument's own shape
    argument = re.escape(str((0,) * bad.dim()))
    with pytest.raises(ValueError, match=rf"^(node set '({declared})' contains non-finite values "
                                         rf"\(NaN or inf\): [1-9]\d* of \d+ entries, the first "
                                         rf"at index \(0, 0, 0\)|{type(model).__name__}: \w+ "
                                         rf"contains non-finite values \(NaN or inf\): "
                                         rf"{int(bad.isnan().sum())} of {bad.numel()} entries, "
                                         rf"the first at index {argument})"):
        sa.compile(model)(bad, *inputs[1:])


@pytest.mark.parametrize("name", sorted(CASES))
def test_factory_is_documented(name):
    factory = sa.models.REGISTRY[CASES[name].model]
    model, _ = CASES[name]()
    assert factory.__doc__ and type(model).__doc__.count("φ") >= 1


# -- a new model is one file and one line -----------------------------------------------------
TOY = '''"""Toy attention: a throw-away catalogue model, written by tests/test_catalogue.py."""

from __future__ import annotations

import torch
from torch import nn

from structattn.checking._validation import check_size
from structattn.declaration import Declaration
from structattn.family import edges, potential, value
from structattn.nodes import nodes
from structattn.potentials import Bilinear
from structattn.priors import Uniform
from structattn.values import Linear

from ._catalogue import Entry, randn64


class ToyAttention(Declaration):
    """φ_i ~ Uniform(all tokens); ψ(x_j, x_i) = x_iᵀWᵀW x_j / √d; v = W x_j."""

    def __init__(self, d=3, dtype=None):
        super().__init__()
        self.d = check_size("ToyAttention", "d", d)
        self.W = nn.Parameter(torch.randn(d, d, dtype=dtype))

    def model(self, x):
        self.check_inputs(x=x)
        tokens = nodes("x", x, features=self.d)
        phi = edges("attn", tokens, tokens, Uniform())
        potential(phi, Bilinear(self.W, self.W))
        return value(phi, Linear(self.W))[..., 0, :, :]

    def example_inputs(self, n=5, batch=1):
        return (self._randn(batch, n, self.d),)


def toy_attention(d=3, **kwargs) -> ToyAttention:
    """A throw-away model; see :class:`ToyAttention`."""
    return ToyAttention(d, **kwargs)


def _case():
    return toy_attention(dtype=torch.float64), (randn64(2, 4, 3),)


ENTRY = Entry(toy_attention, ToyAttention, case=_case, example=dict(d=3), sizes=dict(d=1))
'''

#: the plugin a test session loads to register the toy, as models/__init__.py's line would
PLUGIN = '''import structattn.models

structattn.models.__path__.append({folder!r})
structattn.models.register("toy_attention")
'''


def test_a_new_model_is_one_file_and_one_line(tmp_path, monkeypatch):
    """A model written to a file in the package's folders and registered by the same call as
    the catalogue's own lines joins ``REGISTRY``, ``EXAMPLES``, the public names and the test
    suite's cases; a test session that registers it collects the generic tests for it, and
    they pass. Undone afterwards."""
    import subprocess
    import sys

    from . import registry

    folder, plugins = tmp_path / "models", tmp_path / "plugins"
    folder.mkdir()
    plugins.mkdir()
    (folder / "toy_attention.py").write_text(TOY)
    with monkeypatch.context() as patch:
        patch.setattr(structattn.models, "__path__", [*structattn.models.__path__, str(folder)])
        for table in ("CATALOGUE", "REGISTRY", "EXAMPLES"):
            patch.setattr(sa.models, table, dict(getattr(sa.models, table)))
        for public in ("toy_attention", "ToyAttention"):
            patch.setattr(sa.models, public, None, raising=False)  # removed on undo
        try:
            entry = sa.models.register("toy_attention")  # the one line
            assert sa.models.toy_attention is entry.factory is sa.models.REGISTRY["toy_attention"]
            assert sa.models.ToyAttention is entry.declaration
            assert sa.models.EXAMPLES["toy_attention"] == {"d": 3}
            cases = registry.cases()
            assert cases["toy_attention"].exact and cases["toy_attention"].model == "toy_attention"
            patch.setitem(CASES, "toy_attention", cases["toy_attention"])
            test_every_model_module_is_registered()
            test_entry_states_one_model("toy_attention")
            test_compiled_equals_pyro_enumeration("toy_attention")
            test_nan_input_is_refused("toy_attention")
        finally:
            sys.modules.pop("structattn.models.toy_attention", None)
    assert "toy_attention" not in sa.models.REGISTRY and "toy_attention" not in registry.cases()
    assert not hasattr(sa.models, "toy_attention") and not hasattr(sa.models, "ToyAttention")
    assert str(folder) not in structattn.models.__path__
    # a test session with the toy registered: the generic tests are collected for it and pass
    (plugins / "toy_plugin.py").write_text(PLUGIN.format(folder=str(folder)))
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(plugins), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "toy_plugin", "-p", "no:cacheprovider", "-q",
         "-n", "0",  # one process: 21 tests do not pay for two workers' start-up
         "tests/test_catalogue.py", "tests/test_edge_matrix.py", "tests/drawing/test_networkx.py",
         "tests/drawing/test_model.py", "-k", "toy_attention or every_model_module_is_registered"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    # registration check 1; catalogue checks 5 (entry, Pyro, gradcheck, NaN, docs); the edge
    # matrix's 6 cells and its 6 rows (dtype, device, sizes, sizes stated, NaN input, NaN
    # parameter); 3 drawings (networkx, plate notation, no arrow across a plate label)
    assert proc.returncode == 0 and re.search(r"^21 passed", out, re.M), out
