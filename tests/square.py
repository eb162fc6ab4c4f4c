"""A check shared by the distance-prior tests: a compiled layer never forms an N×N tensor."""

import torch


def assert_no_square_tensor(layer, x: torch.Tensor, n: int):
    """Three calls (read, record, replay): no tensor of the recorded plan's graph and none
    saved for the backward has a trailing ``(n, n)`` shape. Returns the last output (after
    its backward has run)."""
    for _ in range(3):
        y = layer(x)
    (plan,) = layer.plans.values()
    assert plan.graph is not None, plan.reason
    shapes = [tuple(node.meta["val"].shape) for node in plan.graph.graph.nodes
              if isinstance(node.meta.get("val"), torch.Tensor)]
    assert not [s for s in shapes if s[-2:] == (n, n)], shapes
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                  lambda t: t):
        y = layer(x)
    y.sum().backward()
    assert saved and not [s for s in saved if tuple(s[-2:]) == (n, n)], saved
    return y
