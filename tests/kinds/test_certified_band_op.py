"""The certified band as one operator (``kinds/certified_band_op.py``): a certified FoX layer
without a gradient records a plan, the plan's replays choose each call's band on its own
values (what the declaration's reading chooses), and the operator's fake rule matches it."""

import pytest
import torch

import structattn as sa
from structattn.kinds import certified_band_op, key_bias

f64 = torch.float64
pytestmark = pytest.mark.skipif(
    not key_bias.band_applies(torch.zeros(1, 2, 1), torch.zeros(1, 2, 1)),
    reason="the compiled CPU kernels are not built here")


def _layer():
    torch.manual_seed(4)
    return sa.models.forgetting_attention(16, heads=2, gate_bias=-1.0, tol=1e-4, dtype=f64)


@torch.no_grad()
def test_a_certified_layer_records_a_plan_whose_replays_choose_on_their_values():
    m = _layer()
    layer = sa.compile(m)
    sharp = torch.randn(1, 300, 16, dtype=f64)
    spread = 8 * torch.randn(1, 300, 16, dtype=f64)  # (scores over hundreds: wider bands)
    for x in (sharp, sharp, spread, sharp, spread):  # recorded on the first, then replayed
        y = layer(x)
        want, trace = layer.interpret(x, return_trace=True)
        torch.testing.assert_close(y, want, rtol=0, atol=0)
        c = trace.truncation[m.family_name]
        assert c.certified and float(c.bound.max()) <= 1e-4
    (plan,) = layer.plans.values()
    assert plan.graph is not None and plan.calls >= 3
    assert "certified_band" in str(plan.graph.graph)
    widths = [layer.interpret(x, return_trace=True)[1].truncation[m.family_name].heads
              for x in (sharp, spread)]
    assert bool((widths[0] < widths[1]).any())  # the values chose different bands


@pytest.mark.parametrize("pays", [True, False])  # a band read, or the whole past at once
def test_the_operator_matches_its_fake_rule(pays, monkeypatch):
    from structattn.kinds import certificate_costs

    monkeypatch.setattr(certificate_costs, "band_pays", lambda *args: pays)
    g = torch.Generator().manual_seed(0)
    a, b, u = (torch.randn(1, 2, 96, 8, generator=g) for _ in range(3))
    h = -0.3 * torch.arange(96.0).flip(0).expand(1, 2, 96).contiguous()
    torch.library.opcheck(certified_band_op.certified_band, (a, b, u, h, 0.35, 1e-4, 16, 38))
