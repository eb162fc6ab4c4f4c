"""The catalogue on a CUDA device: the same oracle, the same replay, the same module contract.

Skipped where there is no CUDA device (the CPU machines CI runs on); run on a GPU machine with
``python -m pytest tests/test_cuda.py``. Each catalogue case is moved to the GPU in float64 and
checked there against Pyro's exact enumeration run on the GPU too (``sa.inference.compare``),
against the same case on the CPU (outputs and gradients, which the CPU suite checks against
Pyro), replayed bit for bit, and run in float32 and bfloat16 (one dynamo graph on the GPU, and
inductor: tests/test_torch_compile.py, on each device).
"""

import copy
import warnings

import pytest
import torch
from torch.utils import _pytree as pytree

import structattn as sa

from .registry import CASES, EXACT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (none on this machine)")

def _on(model, inputs, device, dtype=None):
    model = copy.deepcopy(model).to(device)
    if dtype is not None:
        model = model.to(dtype)
    inputs = tuple(x.to(device, dtype if dtype is not None and x.is_floating_point() else None)
                   for x in inputs)
    return model, inputs


def _draws_at_random(layer, inputs) -> bool:
    """Whether the layer's output depends on the RNG (slot initialisation): then the CPU and
    the GPU draw different numbers and only the oracle on the GPU can judge it."""
    with torch.no_grad():
        torch.manual_seed(1)
        a = pytree.tree_leaves(layer(*inputs))
        torch.manual_seed(2)
        b = pytree.tree_leaves(layer(*inputs))
    return not all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", EXACT)
def test_compiled_on_cuda_equals_pyro_enumeration_on_cuda(name):
    model, inputs = _on(*CASES[name](), "cuda")
    report = sa.inference.compare(model, *inputs)
    assert report.max_abs_diff < 1e-6, str(report)


@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_output_and_gradients_equal_the_cpu(name):
    model, inputs = CASES[name]()
    cpu = sa.compile(model)
    if _draws_at_random(cpu, inputs):
        pytest.skip("draws at random: judged by the oracle on the GPU (test above)")
    g_model, g_inputs = _on(model, inputs, "cuda")
    gpu = sa.compile(g_model)

    def run(layer, ins):
        ins = tuple(x.detach().requires_grad_() if x.is_floating_point() else x for x in ins)
        out = pytree.tree_leaves(layer(*ins))
        loss = sum((o * torch.linspace(0.5, 1.5, o.numel(), dtype=o.dtype, device=o.device)
                    .reshape(o.shape)).sum() for o in out if o.is_floating_point())
        diff = [x for x in ins if x.is_floating_point()] + list(layer.parameters())
        grads = torch.autograd.grad(loss, diff, allow_unused=True)
        return out, grads

    want, want_g = run(cpu, inputs)
    got, got_g = run(gpu, g_inputs)
    assert all(o.device.type == "cuda" for o in got)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-9, atol=1e-9)
    for a, b in zip(got_g, want_g, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a.cpu(), b, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("name", sorted(CASES))
def test_replay_on_cuda_equals_the_reading_bit_for_bit(name):
    model, inputs = _on(*CASES[name](), "cuda")
    layer = sa.compile(model)
    results = []
    for _ in range(3):  # read, record, replay
        torch.manual_seed(1)
        results.append(pytree.tree_leaves(layer(*inputs)))
    torch.manual_seed(1)
    read = pytree.tree_leaves(layer.interpret(*inputs))
    for got in results:
        assert all(torch.equal(a, b) for a, b in zip(got, read, strict=True)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_low_precision_on_cuda(name, dtype):
    """float32 and bfloat16 on the GPU: the output has the dtype, is finite, and is near the
    float64 reading (bfloat16 keeps ~3 significant digits)."""
    model, inputs = CASES[name]()
    torch.manual_seed(1)
    gold = pytree.tree_leaves(sa.compile(_on(model, inputs, "cuda")[0])(*_on(model, inputs, "cuda")[1]))
    low_model, low_inputs = _on(model, inputs, "cuda", dtype)
    torch.manual_seed(1)
    got = pytree.tree_leaves(sa.compile(low_model)(*low_inputs))
    tol = {torch.float32: 1e-3, torch.bfloat16: 0.15}[dtype]
    for a, b in zip(got, gold, strict=True):
        if not b.is_floating_point():
            continue
        assert a.dtype == dtype and bool(torch.isfinite(a).all())
        err = (a.double() - b).abs().max().item()
        assert err <= tol * (1 + b.abs().max().item()), (name, dtype, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_unchecked_nan_comes_out_as_nan_on_cuda(name, dtype):
    """Validation off: a NaN in the first input, or in any one parameter, comes out as NaN —
    CUDA's fused kernels carry it themselves, so the GPU's readings add no carrier (the CPU's
    return 0 for a row of NaN scores: ``kinds/base.keep_nonfinite_rows``) — or, for a
    parameter the output does not read, leaves the output unchanged. Replayed calls agree
    with a reading, NaN for NaN."""
    base, inputs = _on(*CASES[name](), "cuda", dtype)
    with sa.validation(False):
        torch.manual_seed(1)
        clean = pytree.tree_leaves(sa.compile(base)(*inputs))[0]
        bad = list(inputs)
        bad[0] = inputs[0].clone()
        bad[0].view(-1)[1] = float("nan")
        layer = sa.compile(base)
        outs = []
        for _ in range(3):  # read, record, replay
            torch.manual_seed(1)
            outs.append(pytree.tree_leaves(layer(*bad))[0])
        torch.manual_seed(1)
        read = pytree.tree_leaves(layer.interpret(*bad))[0]
        assert bool(torch.isnan(read).any()), f"{name}, {dtype}: a NaN input came out finite"
        for out in outs:
            torch.testing.assert_close(out, read, rtol=0, atol=0, equal_nan=True)
        for pname, _ in base.named_parameters():
            model = copy.deepcopy(base)
            with torch.no_grad():
                model.get_parameter(pname).view(-1)[0] = float("nan")
            torch.manual_seed(1)
            out = pytree.tree_leaves(sa.compile(model)(*inputs))[0]
            assert bool(torch.isnan(out).any()) or torch.equal(out, clean), (
                f"{name}, {dtype}: NaN in parameter {pname!r} gave a finite, different output")


def test_a_cpu_input_to_a_cuda_layer_is_refused_by_name():
    m = sa.models.self_attention(7, d_k=3, heads=2, device="cuda")
    with pytest.raises(ValueError, match=r"^SelfAttention: x is on cpu but parameter W_q is on "
                                         r"cuda:0; move one of them"):
        sa.compile(m)(torch.randn(2, 5, 7))


def test_nan_on_cuda_is_refused():
    """Read and recorded calls check in the call; a replayed one queues its verdict
    (``structattn.checking.verdicts``): the error comes at the next call or at ``raise_pending()``."""
    m = sa.models.self_attention(7, d_k=3, heads=2, device="cuda")
    x = torch.randn(2, 5, 7, device="cuda")
    bad = x.clone()
    bad[1, 2, 3] = float("nan")
    layer = sa.compile(m)
    for _ in range(2):  # read, record (whose replay fails its flag: read again, raising)
        with pytest.raises(ValueError, match=r"contains non-finite values"):
            layer(bad)
    assert torch.isnan(layer(bad)).any()  # replayed: returned, its verdict on its way
    with pytest.raises(ValueError, match=r"'x' contains non-finite values .* \(1, 2, 3\)"):
        sa.raise_pending()
    layer(bad)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"contains non-finite values") as err:
        layer(x)  # the next call, once the GPU has run the bad one
    assert "earlier call" in "".join(err.value.__notes__)
    sa.set_validation(True, queued=False)
    try:
        with pytest.raises(ValueError, match=r"contains non-finite values"):
            layer(bad)
    finally:
        sa.set_validation(True, queued=True)


def test_a_replayed_call_with_checks_on_does_not_wait_for_the_gpu():
    """Forward and backward of a replayed call, checks on, under CUDA's sync debug mode set to
    raise on any synchronisation; a parameter step (its check queued too) included."""
    m = sa.models.self_attention(64, d_k=16, heads=4, device="cuda")
    layer = sa.compile(m)
    x = torch.randn(8, 128, 64, device="cuda", requires_grad=True)
    for _ in range(3):
        layer(x).sum().backward()
    torch.cuda.synchronize()
    try:
        with warnings.catch_warnings():  # "a prototype feature" (a UserWarning)
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        for _ in range(3):
            layer(x).sum().backward()
            with torch.no_grad():
                m.W_q.add_(1e-3)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    sa.raise_pending()


def test_state_dict_saved_on_cuda_loads_on_cpu(tmp_path):
    m = sa.models.self_attention(8, d_k=4, heads=2, device="cuda")
    torch.save(sa.compile(m).state_dict(), tmp_path / "w.pt")
    cpu = sa.models.self_attention(8, d_k=4, heads=2)
    cpu_layer = sa.compile(cpu)
    cpu_layer.load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True, map_location="cpu"))
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(cpu_layer(x), sa.compile(m)(x.cuda()).cpu(), rtol=1e-5, atol=1e-5)
