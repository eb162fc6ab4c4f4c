"""A check shared by the distance-prior tests: a compiled layer never forms an N×N tensor."""

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class OpShapes(TorchDispatchMode):
    """Inside it, every operator that runs (aten's and the library's own, each as one call: what
    runs inside a custom operator is not seen) is noted with its outputs' shapes, in
    ``ops``: ``[(name, (shape, …)), …]``. A plan keeps none of its tracer's notes (no
    ``meta["val"]``): its nodes' shapes are those of the ops its replay runs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((str(func), tuple(tuple(t.shape) for t in pytree.tree_leaves(out)
                                           if isinstance(t, torch.Tensor))))
        return out

    def square(self, n: int) -> list:
        """The ops with an output whose last two dims are ``(n, n)``."""
        return [(name, shapes) for name, shapes in self.ops
                if any(s[-2:] == (n, n) for s in shapes)]


def assert_no_square_tensor(layer, x: torch.Tensor, n: int):
    """Three calls (read, record, replay): no op of the replayed plan, forward or backward,
    outputs a tensor with a trailing ``(n, n)`` shape, and none is saved for the backward.
    Returns the last output (after its backward has run)."""
    for _ in range(2):
        layer(x)
    (plan,) = layer.plans.values()
    assert plan.graph is not None, plan.reason
    calls, saved, shapes = plan.calls, [], OpShapes()
    with shapes, torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.shape) or t, lambda t: t):
        y = layer(x)
        y.sum().backward()
    assert plan.calls == calls + 1  # the call replayed the plan
    assert shapes.ops and not shapes.square(n), shapes.square(n)
    assert saved and not [s for s in saved if tuple(s[-2:]) == (n, n)], saved
    return y
