"""What the Triton tests check of a whole compiled layer, written once for every kernel."""

import torch

import structattn as sa
from structattn import triton_kernels


def assert_layer_equals_pyro_and_dense_gradients(m, x):
    """The layer through the Triton kernels (``on_cpu``) equals Pyro's exact enumeration, and
    its gradients in the input and every parameter equal those of the readings without any
    compiled kernel (``sa.kernels.disabled()``: autograd through PyTorch)."""
    exact = sa.inference.exact(m, x)
    with triton_kernels.on_cpu():
        y = sa.compile(m)(x)
    torch.testing.assert_close(y, exact.output, rtol=0, atol=1e-10)
    params = [p for p in m.parameters() if p.requires_grad]
    xs = x.clone().requires_grad_()
    with triton_kernels.on_cpu():
        got = torch.autograd.grad(sa.compile(m)(xs).square().sum(), [xs, *params])
    with sa.kernels.disabled():
        want = torch.autograd.grad(sa.compile(m)(xs).square().sum(), [xs, *params])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


def assert_one_node_of_a_plan(m, x, op: str):
    """Three calls through the Triton kernels (read, record, replay): the plan holds ``op``
    once, and every call equals the reading without compiled kernels. Returns the layer."""
    layer = sa.compile(m)
    with triton_kernels.on_cpu():
        ys = [layer(x) for _ in range(3)]
    (plan,) = layer.plans.values()
    targets = [str(n.target) for n in plan.graph.graph.nodes if n.op == "call_function"]
    assert sum(f"structattn_triton.{op}" in t for t in targets) == 1, targets
    with sa.kernels.disabled():
        plain = layer(x)
    for y in ys:
        torch.testing.assert_close(y, plain, rtol=0, atol=1e-12)
    return plain
