"""Every distance prior with a Triton kernel reaches it in every dtype a GPU user trains in:
float32, bfloat16 and float16 parameters, and float32 parameters under autocast to bfloat16
(``torch.autocast`` on the inputs' device: CPU autocast under the interpreter, as CUDA's on a
GPU). A compiled FoX, causal ALiBi, generalised-Gaussian or stick-breaking layer records the
kernel's operator in its plan, and no tensor of the plan nor any saved for the backward is N×N;
its output and the gradients of its input and of every parameter equal the float64 layer's at
the same (rounded) parameters and input, within the dtype's rounding."""

import contextlib

import pytest
import torch

import structattn as sa
from structattn import triton_kernels

from ..square import OpShapes

f64 = torch.float64
#: where the kernels run: the GPU where there is one, else the CPU under the interpreter
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
N = 40  # tokens: across the interpreter's blocks of 32
#: expanding attention's tokens, across the blocks of 32 too: a block's children iterate until
#: its slowest settles, under the interpreter step by step (this seed, float32: 20 steps at
#: most at 34 tokens, 32 at 40)
N_EXPANDING = 34

#: the layers, their options and the Triton operator each must record
LAYERS = {
    "fox": ("forgetting_attention", {}, "key_bias_forward"),
    "alibi": ("alibi_attention", {"causal": True}, "key_bias_forward"),
    "stick_breaking": ("stick_breaking_attention", {}, "stick_breaking_forward"),
    "generalised_gaussian": ("generalised_gaussian_attention", {},
                             "generalised_gaussian_forward"),
}

#: (the parameters' dtype, autocast's dtype or None, the output's and the gradients' tolerance
#: relative to their norms): float32 to its products' rounding; bfloat16 and float16, the
#: projections and the kernel in them, to ~10 units of their rounding (2⁻⁹, 2⁻¹¹: measured
#: at these sizes, outputs 0.3–0.9% and 0.05%, gradients up to 2.5% and 0.17%). A gradient
#: that is a sum which cancels — the forget gate's, Σ_{j<l} ∂L/∂h_j with Σ_j ∂L/∂h_j = 0 — is
#: as far from float64 in PyTorch's own reading of the same dtype (the dense table, kernels
#: off): there the kernel's may be up to three times as far (this seed's FoX gate under
#: autocast: 2×; over five seeds 0.5–5×, the output kept in half precision)
DTYPES = {
    "float32": (torch.float32, None, 1e-5, 1e-5),
    "bfloat16": (torch.bfloat16, None, 2e-2, 3e-2),
    "float16": (torch.float16, None, 3e-3, 5e-3),
    "float32-autocast-bfloat16": (torch.float32, torch.bfloat16, 2e-2, 3e-2),
}


@pytest.mark.parametrize("dtype_case", sorted(DTYPES))
@pytest.mark.parametrize("layer_case", sorted(LAYERS))
def test_a_layer_reaches_its_kernel_in_every_training_dtype(layer_case, dtype_case):
    model, options, op = LAYERS[layer_case]
    dtype, autocast, rtol, grad_rtol = DTYPES[dtype_case]
    torch.manual_seed(len(layer_case) + len(dtype_case))
    factory = getattr(sa.models, model)
    m = factory(8, heads=2, d_k=4, dtype=dtype, device=DEVICE, **options)
    with torch.no_grad():  # gates and logits away from 0, so that the priors matter
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.7)
    exact = factory(8, heads=2, d_k=4, dtype=f64, device=DEVICE, **options)
    exact.load_state_dict({k: v.to(f64) for k, v in m.state_dict().items()})
    x = torch.randn(2, N, 8, device=DEVICE).to(dtype).requires_grad_()
    params = [p for p in m.parameters() if p.requires_grad]
    layer = sa.compile(m)
    cast = (torch.autocast(DEVICE.type, autocast) if autocast is not None
            else contextlib.nullcontext())
    saved, shapes = [], OpShapes()
    with triton_kernels.on_cpu(), cast:
        for _ in range(2):  # read, record
            layer(x)
        (plan,) = layer.plans.values()
        calls = plan.calls
        with shapes, torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t.shape) or t, lambda t: t):
            y = layer(x)
            dout = torch.randn_like(y, dtype=f64)
            grads = torch.autograd.grad((y.to(f64) * dout).sum(), [x, *params])
    assert plan.calls == calls + 1  # the call replayed the plan
    assert y.dtype == (autocast or dtype)
    targets = [str(n.target) for n in plan.graph.graph.nodes if n.op == "call_function"]
    assert sum(f"structattn_triton.{op}" in t for t in targets) == 1, targets
    ran = [name for name, _ in shapes.ops]
    assert f"structattn_triton.{op}.default" in ran, ran  # and its backward's operator
    assert f"structattn_triton.{op.replace('forward', 'backward')}.default" in ran, ran
    assert shapes.ops and not shapes.square(N), shapes.square(N)
    assert saved and not [s for s in saved if tuple(s[-2:]) == (N, N)], saved
    x64 = x.detach().to(f64).requires_grad_()
    with sa.kernels.disabled():
        want = sa.compile(exact)(x64)
        with cast:  # PyTorch's own reading in the same dtype
            plain = sa.compile(m)(x)
            plain_grads = torch.autograd.grad((plain.to(f64) * dout).sum(), [x, *params])
    want_grads = torch.autograd.grad((want * dout).sum(), [x64, *exact.parameters()])
    err = float((y.detach().to(f64) - want.detach()).norm() / want.detach().norm())
    assert err <= rtol, (err, rtol)
    for g, p, w in zip(grads, plain_grads, want_grads, strict=True):
        assert g.dtype == dtype
        off, plain_off = ((t.to(f64) - w).norm() / w.norm() for t in (g, p))
        assert off <= max(grad_rtol, 3 * plain_off), (g.shape, float(off), float(plain_off))


@pytest.mark.parametrize("dtype_case", sorted(DTYPES))
def test_expanding_attention_reaches_its_kernels_in_every_training_dtype(dtype_case):
    """The beta-geometric prior's mean field (expanding attention, ``grad="last"``) runs its
    solve and its band per child in Triton, forward and backward, in every training dtype,
    with no op of an N×N output. (Its windows depend on the values, so a rounding may move
    one: its values are checked against float64 in ``test_expanding_triton.py``.)"""
    dtype, autocast = DTYPES[dtype_case][:2]
    torch.manual_seed(7)
    m = sa.models.expanding_attention(8, heads=2, d_k=4, dtype=dtype, device=DEVICE,
                                      inference=sa.MeanFieldWindows(grad="last"))
    x = torch.randn(1, N_EXPANDING, 8, device=DEVICE).to(dtype).requires_grad_()
    cast = (torch.autocast(DEVICE.type, autocast) if autocast is not None
            else contextlib.nullcontext())
    shapes = OpShapes()
    with triton_kernels.on_cpu(), cast, shapes:
        y = sa.compile(m)(x)
        grads = torch.autograd.grad(y.float().square().sum(), [x, *m.parameters()])
    assert y.dtype == (autocast or dtype)
    ran = {name for name, _ in shapes.ops}
    for op in ("mean_field_solve", "mean_field_attend_forward", "mean_field_attend_backward"):
        assert f"structattn_triton.{op}.default" in ran, sorted(ran)
    assert not shapes.square(N_EXPANDING), shapes.square(N_EXPANDING)
    assert all(bool(g.isfinite().all()) for g in grads)
