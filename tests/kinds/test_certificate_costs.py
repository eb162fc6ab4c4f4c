"""The CPU's cost rules for certified readings (``kinds/window.py``): a certificate whose own
work, or whose readings, would cost more than reading the whole past is not computed — the
layer reads the whole past at once (bound 0), exactly as the layer without ``tol``, and says
so in its trace; where a band is expected to pay, it is read."""

import pytest
import torch

import structattn as sa
from structattn.kinds import certificate_costs, key_bias, window

f64 = torch.float64
pytestmark = pytest.mark.skipif(
    not key_bias.band_applies(torch.zeros(1, 2, 1), torch.zeros(1, 2, 1)),
    reason="the compiled CPU kernels are not built here")


def test_the_band_cost_model_reads_long_sharp_sequences_and_not_short_ones():
    pays = certificate_costs.band_pays
    assert pays(torch.full((4,), 128), 8192, 64)  # 1/64 of the sequence: a band pays
    assert not pays(torch.full((4,), 128), 2048, 64)  # its fixed cost at 2,048: it does not
    assert not pays(torch.full((4,), 8191), 8192, 64)  # every head all of its past
    assert not pays(torch.tensor([64, 8191, 8191, 8191]), 8192, 64)  # three of four heads


@pytest.mark.parametrize("factory", ["forgetting_attention", "alibi_attention"])
def test_where_a_band_cannot_pay_the_whole_past_is_read_as_without_tol(factory, monkeypatch):
    from structattn.kinds import certified_band_op

    read = []
    monkeypatch.setattr(certified_band_op, "band_rows",
                        lambda *args: read.append(args) or pytest.fail("a band was read"))
    torch.manual_seed(2)
    kw = {"gate_bias": -1.0} if factory == "forgetting_attention" else {}
    m = getattr(sa.models, factory)(16, heads=2, tol=1e-4, dtype=f64, **kw)
    exact = getattr(sa.models, factory)(16, heads=2, dtype=f64, **kw)
    exact.load_state_dict(m.state_dict())
    x = torch.randn(1, 300, 16, dtype=f64)
    with torch.no_grad():
        y, trace = sa.compile(m)(x, return_trace=True)
    c = trace.truncation[m.family_name]
    assert c.skipped == 0 and c.certified and bool((c.bound == 0).all()) and not read
    torch.testing.assert_close(y, sa.compile(exact)(x), rtol=0, atol=1e-12)


def test_where_a_band_pays_it_is_read():
    torch.manual_seed(2)
    m = sa.models.forgetting_attention(16, heads=2, gate_bias=-2.0, tol=1e-4)
    with torch.no_grad():
        _, trace = sa.compile(m)(torch.randn(1, 8192, 16), return_trace=True)
    c = trace.truncation[m.family_name]
    assert c.certified and c.skipped > 0.9 and bool((c.bound <= 1e-4).all())


def test_the_rules_can_be_set_aside_to_measure_what_a_certificate_proves():
    from structattn.kinds.certificate_costs import set_aside

    torch.manual_seed(2)
    m = sa.models.forgetting_attention(16, heads=2, gate_bias=-1.0, tol=1e-4, dtype=f64)
    x = torch.randn(1, 300, 16, dtype=f64)
    with torch.no_grad():
        _, fast = sa.compile(m)(x, return_trace=True)
        with set_aside():
            assert certificate_costs.band_pays(torch.full((2,), 16), 300, 16)
            _, proved = sa.compile(m)(x, return_trace=True)
    assert fast.truncation[m.family_name].skipped == 0  # (300 tokens: not worth a band)
    c = proved.truncation[m.family_name]
    assert c.certified and c.skipped > 0.5 and bool((c.heads < 150).all())


def test_the_table_cost_model_certifies_long_sequences_and_not_short_ones():
    from structattn.kinds.certificate_costs import table_band_pays

    assert table_band_pays(torch.full((4,), 512), 8192, 64, False)  # 1/16 of the sequence
    assert not table_band_pays(torch.full((4,), 16), 2048, 64, False)  # the certificate alone
    assert not table_band_pays(torch.full((4,), 8191), 8192, 64, True)  # all of the past
    assert table_band_pays(torch.full((4,), 256), 4096, 64, True) \
        and not table_band_pays(torch.full((4,), 256), 4096, 64, False)  # with a backward


def _gaussian(n: int, **kw):
    torch.manual_seed(3)  # (heads of 64: the sizes the rule was measured at)
    m = sa.models.generalised_gaussian_attention(128, heads=2, width=8.0, **kw)
    return m, torch.randn(1, n, 128)


def test_a_table_certificate_not_worth_its_cost_is_not_computed(monkeypatch):
    from structattn.certificates import certified
    from structattn.kinds import distance_table

    monkeypatch.setattr(window, "certify", lambda *a, **k: pytest.fail("certify was called"))
    monkeypatch.setattr(distance_table, "band_attention",
                        lambda *a, **k: pytest.fail("a band was read"))
    m, x = _gaussian(1024, tol=1e-4)
    exact = sa.models.generalised_gaussian_attention(128, heads=2, width=8.0)
    exact.load_state_dict(m.state_dict())
    with torch.no_grad():
        y, trace = sa.compile(m)(x, return_trace=True)
        torch.testing.assert_close(y, sa.compile(exact)(x), rtol=0, atol=0)
    c = trace.truncation[m.family_name]
    assert isinstance(c, certified.CertifiedWindow)
    assert c.skipped == 0 and c.certified and bool((c.bound == 0).all())


def test_a_table_certificate_worth_its_cost_is_read():
    m, x = _gaussian(8192, tol=1e-4)
    with torch.no_grad():
        _, trace = sa.compile(m)(x, return_trace=True)
    c = trace.truncation[m.family_name]
    assert c.certified and c.skipped > 0.8 and bool((c.bound <= 1e-4).all())


def test_a_table_certificate_refused_by_the_sizes_alone_takes_no_sample_and_is_recorded(
        monkeypatch):
    """Where not even the narrowest band would pay for the certificate (the sizes alone say
    so: no value read), no sample is taken, and the call, reading no value, is recorded as a
    plan and replayed — equal to the layer without ``tol``."""
    from structattn.certificates import sampled
    from structattn.kinds import certificate_costs

    monkeypatch.setattr(certificate_costs, "sampled_widths",
                        lambda *a, **k: pytest.fail("a sample was taken"))
    monkeypatch.setattr(sampled, "sampled_widths",
                        lambda *a, **k: pytest.fail("a sample was taken"))
    m, x = _gaussian(1024, tol=1e-4)
    exact = sa.models.generalised_gaussian_attention(128, heads=2, width=8.0)
    exact.load_state_dict(m.state_dict())
    layer = sa.compile(m)
    with torch.no_grad():
        ys = [layer(x) for _ in range(3)]
        want = sa.compile(exact)(x)
    (plan,) = layer.plans.values()
    assert plan.graph is not None, plan.reason
    for y in ys:
        torch.testing.assert_close(y, want, rtol=0, atol=0)


def test_the_sizes_alone_reject_a_band_no_width_of_which_pays(monkeypatch):
    """At 300 tokens no band read by every head pays for the certificate: rejected without
    a score computed."""
    from structattn.certificates.certified_read import widths_from

    monkeypatch.setattr(certificate_costs, "last_child_widths",
                        lambda *a, **k: pytest.fail("a score was computed"))
    a = b = torch.zeros(1, 2, 300, 16)
    h = torch.zeros(1, 2, 300)
    assert certificate_costs.band_rejected(a, b, h, 0.25, (1, 2), widths_from(299, 16, 120),
                                           1e-4)


@pytest.mark.parametrize("gate_bias, rejected", [(12.0, True), (-3.0, False)])
def test_the_last_child_rejects_a_band_before_any_sample(gate_bias, rejected, monkeypatch):
    """FoX at 2,048 tokens: a band pays only where every head is narrow; with slow gates the
    last child's exact mass exceeds eps beyond any narrow band — the whole past is read, no
    sample taken, as the layer without ``tol``; with sharp gates it does not, and the sample
    and the band follow (and skip most pairs)."""
    from structattn.certificates import certified_read

    sampled = []
    real = certified_read.sampled_widths
    monkeypatch.setattr(certified_read, "sampled_widths",
                        lambda *a, **k: sampled.append(1) or real(*a, **k))
    torch.manual_seed(2)
    m = sa.models.forgetting_attention(256, heads=4, gate_bias=gate_bias, tol=1e-4)
    exact = sa.models.forgetting_attention(256, heads=4, gate_bias=gate_bias)
    exact.load_state_dict(m.state_dict())
    x = torch.randn(1, 2048, 256)
    with torch.no_grad():
        y, trace = sa.compile(m)(x, return_trace=True)
        want = sa.compile(exact)(x)
    c = trace.truncation[m.family_name]
    assert bool(sampled) is not rejected
    if rejected:
        assert c.skipped == 0 and bool((c.bound == 0).all())
        torch.testing.assert_close(y, want, rtol=0, atol=0)
    else:
        assert c.certified and c.skipped > 0.9 and bool((c.bound <= 1e-4).all())


@pytest.mark.parametrize("model, kw, scale, computed", [
    ("alibi_attention", {}, 6.0, False),
    ("forgetting_attention", {"gate_bias": 0.0}, 1.0, True)])
def test_a_block_certificate_whose_scoring_would_cost_a_reading_is_not_sampled(
        model, kw, scale, computed, monkeypatch):
    """With a gradient and 128 key blocks the block certificate may pay on the CPU; ALiBi on
    large tokens (scores spread over hundreds: the ceilings loose) would have to score most
    blocks exactly — the last sampled child says so by its ceilings against its exact mass,
    no block of the sample is scored, and the layer equals the one without ``tol``. FoX's
    sharp gate leaves few to score: the sample and the certificate follow, and skip most
    pairs."""
    from structattn import block_sparse

    chosen = []
    real = block_sparse.choose_blocks
    monkeypatch.setattr(block_sparse, "choose_blocks",
                        lambda *a, **k: chosen.append(1) or real(*a, **k))
    torch.manual_seed(2)
    m = getattr(sa.models, model)(32, heads=4, d_k=16, tol=1e-4, certificate="blocks",
                                  block_size=8, **kw)
    exact = getattr(sa.models, model)(32, heads=4, d_k=16, **kw)
    exact.load_state_dict(m.state_dict())
    x = torch.randn(1, 1024, 32) * scale
    y, trace = sa.compile(m)(x, return_trace=True)
    c = trace.truncation[m.family_name]
    assert bool(chosen) is computed
    if computed:
        assert c.certified and c.skipped > 0.9 and bool((c.bound <= 1e-4).all())
    else:
        assert c.skipped == 0 and bool((c.bound == 0).all())
        torch.testing.assert_close(y, sa.compile(exact)(x), rtol=1e-6, atol=1e-6)
    assert certificate_costs.block_budget(x) == 0.05
    with certificate_costs.set_aside():
        assert certificate_costs.block_budget(x) is None
