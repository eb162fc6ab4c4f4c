"""Which reading each family took (``kinds/lowered.py``): ``layer.explain`` and the trace name
it, a dense one says why, and a dense reading of N ≥ 4,096 tokens warns once, naming the
family and the reason."""

import warnings

import pytest
import torch

import structattn as sa
from structattn.kinds import block_support, distance_table, lowered

from ..programs import one_family_program

f64 = torch.float64


class PowerLaw(sa.priors.DistancePrior):
    def __init__(self):
        super().__init__("PowerLaw prior", causal=True)

    def log_at_distance(self, d, dtype=None):
        return -torch.log1p(d.abs().to(dtype or f64))[None]


class LogWeightOnly(sa.priors.Prior):
    """A non-stationary prior stating log_weight alone: log w_ij = −|i − j|·(1 + i)/10."""

    def support(self, num_children, num_parents):
        return sa.kinds.Causal()

    def log_weight(self, child, parent, sizes):
        return -(child - parent).abs().to(f64) * (1 + child).to(f64) / 10


class Band(sa.kinds.Support):
    def contains(self, child, parent):
        return (child - parent).abs() <= 2


class BandPrior(sa.priors.Prior):
    def support(self, num_children, num_parents):
        return Band()


def _explain(prior_fn, n=12, **kwargs):
    program, _ = one_family_program(prior_fn)
    return sa.compile(program).explain(torch.randn(1, n, 4, dtype=f64), **kwargs)["attn"]


def test_explain_names_the_fast_readings():
    assert _explain(lambda: sa.priors.Uniform(causal=True)).reading == "sdpa"
    assert _explain(lambda: sa.priors.ALiBi(1, causal=True)).reading == "key-bias terms"
    low = _explain(PowerLaw, n=9)
    if distance_table._ops() is not None:
        assert (low.reading, low.reason, low.size) == ("distance table", None, (9, 9))
        assert str(low) == "distance table (9×9)"
    assert _explain(lambda: sa.priors.RelativePosition(torch.zeros(5, dtype=f64))).reading in (
        "distance table", "dense")


@pytest.mark.parametrize("prior, words", [
    (BandPrior, "its support (Band) is read as a (C, P) mask"),
    (LogWeightOnly, "states neither per-token terms nor a log weight of i − j alone"),
])
def test_a_dense_reading_says_why(prior, words):
    low = _explain(prior)
    assert low.reading == "dense" and low.dense
    assert words in low.reason, low.reason


def test_a_distance_table_without_its_kernel_says_so():
    with sa.kernels.disabled():
        low = _explain(PowerLaw)
    assert low.reading == "dense" and "distance-table kernel is off" in low.reason
    W = torch.randn(2, 4, dtype=torch.bfloat16)

    def program(x):  # bfloat16: the kernel reads float32 and float64 only
        t = sa.nodes("x", x)
        phi = sa.edges("attn", t, t, PowerLaw())
        sa.potential(phi, sa.potentials.Bilinear(W, W))
        return sa.value(phi, sa.values.Linear(W))
    low = sa.compile(program).explain(torch.randn(1, 6, 4, dtype=torch.bfloat16))["attn"]
    assert low.reading == "dense" and "float32 and float64, not bfloat16" in low.reason


def test_the_trace_holds_the_readings():
    """A returned trace (here a stick-breaking family's) carries every family's reading."""
    program, _ = one_family_program(lambda: sa.priors.StickBreaking())
    *_, trace = sa.compile(program)(torch.randn(1, 6, 4, dtype=f64), return_trace=True)
    assert trace.lowering["attn"].reading == "stick-breaking"


def test_a_large_dense_reading_warns_once(monkeypatch):
    """A lone mask (its own C×P table) at 4,096 tokens: one warning naming the family and the
    reason; none at 64 tokens, none the second time."""
    monkeypatch.setattr(lowered, "_warned", set())
    n = lowered.DENSE_WARNING_SIZE
    mask = torch.rand(n, n, generator=torch.Generator().manual_seed(0)) < 0.5
    mask |= torch.eye(n, dtype=torch.bool)
    program, _ = one_family_program(lambda m: sa.priors.Uniform(support=m))
    layer = sa.compile(program, replay=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        layer(torch.randn(1, 64, 4, dtype=f64), mask[:64, :64])  # small: no warning
        assert not [w for w in seen if w.category is lowered.DenseReadingWarning]
        x = torch.randn(1, n, 4, dtype=f64)
        layer(x, mask)
        layer(x, mask)  # the second time: nothing new
    got = [str(w.message) for w in seen if w.category is lowered.DenseReadingWarning]
    assert len(got) == 1, got
    assert "edge family 'attn' (4096 children × 4096 parents) is read densely" in got[0]
    assert "its support (mask) is read as a (C, P) mask: a lone Mask is its own" in got[0]


def test_a_band_of_4096_tokens_is_read_by_blocks_without_a_warning(monkeypatch):
    monkeypatch.setattr(lowered, "_warned", set())
    program, _ = one_family_program(BandPrior)
    x = torch.randn(1, lowered.DENSE_WARNING_SIZE, 4, dtype=f64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        low = sa.compile(program).explain(x)["attn"]
    assert not [w for w in seen if w.category is lowered.DenseReadingWarning]
    if block_support._ops() is not None:
        assert low.reading == "blocks" and low.visited < 0.05, low
        assert str(low).startswith("blocks (4096×4096), ")


def test_a_prior_of_log_weight_alone_is_read_by_rows_from_1024_tokens():
    low = _explain(LogWeightOnly, n=1100)
    assert low.reading == "rows" and low.reason is None, low
