"""Each rewrite of a recorded plan (``structattn/plans/record.py``) is a named pass that keeps
every value bit for bit: a plan recorded without it replays exactly what the plan with it
replays, for every catalogue model, and the pass does change some plan (it is not idle)."""

import pytest
import torch
from torch.utils import _pytree as pytree

import structattn as sa
import structattn.plans.record as record

from ..registry import CASES

#: pass name (as ``record`` calls it) → what leaves it out
PASSES = {
    "_simplify": lambda graph, merge=True: None,
    "_drop_implied_checks": lambda graph, plan, n_state: None,
    "_bind_to_torch": lambda graph, args: None,
    "_split_constants": lambda graph, k: None,
}
#: the grad modes a pass acts differently in (constants are split, and implied checks
#: dropped, the same way with or without gradients)
GRAD_MODES = {"_simplify": (False, True), "_bind_to_torch": (False, True),
              "_drop_implied_checks": (False,), "_split_constants": (False,)}
#: the cases whose reading is recorded (mean-field windows read tensor values: no plan)
RECORDED = sorted(c for c in CASES if c != "expanding_attention")


def _replayed(case, grad: bool):
    """The third call's output (and the parameters' gradients when ``grad``) and its plan."""
    torch.manual_seed(0)  # the same parameters and inputs with and without the pass
    model, inputs = CASES[case]()
    layer = sa.compile(model)
    params = [p for p in layer.parameters() if p.requires_grad]
    with torch.set_grad_enabled(grad):
        for _ in range(3):  # read, record, replay
            torch.manual_seed(1)
            out = layer(*inputs)
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    grads = ()
    if grad and params and leaves[0].requires_grad:
        grads = torch.autograd.grad(leaves[0].sum(), params, allow_unused=True)
    return leaves, grads, layer._plans._last.plan if layer._plans._last else None


#: (case, grad) → ``_replayed`` with every pass: the same in each pass's test, so a worker that
#: runs several of them reads, records and replays each case once
_WITH_EVERY_PASS: dict = {}


def _with_every_pass(case, grad: bool):
    if (case, grad) not in _WITH_EVERY_PASS:
        _WITH_EVERY_PASS[case, grad] = _replayed(case, grad)
    return _WITH_EVERY_PASS[case, grad]


def _shape_of(plan):
    if plan is None or plan.graph is None:
        return None
    count = [len(plan.graph.graph.nodes), [str(n.target) for n in plan.graph.graph.nodes]]
    if plan.constants_graph is not None:
        count.append(len(plan.constants_graph.graph.nodes))
    return count


#: the default run's cases: each catalogue model's default configuration (its variants run
#: with ``-m slow``)
DEFAULTS = [c for c in RECORDED if ":" not in c]


#: with gradients, in the default run: one model of each reading (single-shot, a latent's
#: loop, slots drawn at random, an edge list, an energy)
WITH_GRADIENTS = ["self_attention", "hopfield", "slot_attention", "graph_attention",
                  "predictive_coding"]


@pytest.mark.parametrize("name", sorted(PASSES))
def test_each_pass_keeps_every_value_bit_for_bit(name, monkeypatch):
    _sweep(name, DEFAULTS, (False,), monkeypatch)
    if True in GRAD_MODES[name]:
        _sweep(name, WITH_GRADIENTS, (True,), monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PASSES))
def test_each_pass_keeps_every_value_bit_for_bit_in_every_variant(name, monkeypatch):
    _sweep(name, RECORDED, (False, True), monkeypatch)


def _sweep(name, cases, grad_modes, monkeypatch):
    changed = []
    for case in cases:
        for grad in grad_modes:
            with_pass = _with_every_pass(case, grad)
            with monkeypatch.context() as patch:
                patch.setattr(record, name, PASSES[name])
                without = _replayed(case, grad)
            assert without[2] is not None and without[2].graph is not None, case
            for a, b in zip(with_pass[0], without[0], strict=True):
                assert torch.equal(a, b), (name, case, grad)
            for a, b in zip(with_pass[1], without[1], strict=True):
                assert (a is None and b is None) or torch.equal(a, b), (name, case, grad)
            if _shape_of(with_pass[2]) != _shape_of(without[2]):
                changed.append((case, grad))
    assert changed, f"{name} changed no plan of the catalogue: the test could not fail"
