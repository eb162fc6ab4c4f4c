"""plot_attention (structattn/drawing/summary.py): a long sequence's attention as statistics —
what each panel plots is checked against the compiled posterior, computed here by hand."""

import matplotlib

matplotlib.use("Agg")
import pytest  # noqa: E402
import torch  # noqa: E402

import structattn as sa  # noqa: E402
from structattn.drawing.summary import _distance_density  # noqa: E402

f64 = torch.float64


def _panels(fig):
    return [a for a in fig.axes if a.get_label() != "<colorbar>"]


def _collection(ax, label):
    (c,) = [c for c in ax.collections if c.get_label() == label]
    return c


def test_panels_show_the_map_parents_distances_and_spread_of_the_posterior():
    torch.manual_seed(0)
    m = sa.models.self_attention(8, heads=2, causal=True, dtype=f64)
    x = torch.randn(1, 120, 8, dtype=f64) * 3
    fig = sa.plot_attention(m, x)
    _, P = sa.compile(m)(x, return_posterior=True)
    P = P[0].detach()  # (H, C, P)
    axes = _panels(fig)
    assert len(axes) == 2 * 3
    for h in range(2):
        scatter, _, spread = axes[3 * h: 3 * h + 3]
        xy = torch.as_tensor(scatter.collections[0].get_offsets().data)
        assert xy[:, 0].tolist() == list(range(120))
        assert xy[:, 1].tolist() == P[h].argmax(-1).tolist()  # each child's MAP parent
        # the spread: 5% and 95% quantiles of the parent, as distances i − j, brute force
        band = spread.collections[0].get_paths()[0].vertices
        cdf = P[h].cumsum(-1)
        lo = torch.tensor([int((cdf[i] < 0.05 * cdf[i, -1]).sum()) for i in range(120)])
        hi = torch.tensor([int((cdf[i] < 0.95 * cdf[i, -1]).sum()) for i in range(120)])
        ys = {round(float(v), 6) for v in band[:, 1]}
        assert {float(i - j) for i, j in enumerate(hi.tolist())} <= ys
        assert {float(i - j) for i, j in enumerate(lo.tolist())} <= ys


def test_distance_density_keeps_the_mass_and_is_exact_near_zero():
    torch.manual_seed(1)
    C = 300
    table = torch.softmax(torch.randn(C, C, dtype=f64), -1).tril()
    table = table / table.sum(-1, keepdim=True)
    centres, density = _distance_density(table)
    # bins are integer-centred, exact up to distance 8, then geometric: rebuild their widths
    mass_at = {d: float(table.diagonal(-d).sum()) for d in range(C)}
    for d in range(9):
        (k,) = (centres == d).nonzero().flatten().tolist()
        assert float(density[k]) == pytest.approx(mass_at[d], rel=1e-12)
    edges = torch.cat([centres[:1] - 0.5, (centres[1:] + centres[:-1]) / 2, centres[-1:] + 0.5])
    assert float((density * (edges[1:] - edges[:-1])).sum()) == pytest.approx(C, rel=1e-3)


def test_mean_field_windows_and_cross_attention():
    torch.manual_seed(2)
    e = sa.models.expanding_attention(8, heads=1, dtype=f64)
    x = torch.randn(1, 90, 8, dtype=f64) * 3
    fig = sa.plot_attention(e, x)
    _, trace = sa.compile(e)(x, return_trace=True)
    w = _collection(_panels(fig)[-1], "window W_i (mean field)").get_offsets().data[:, 1]
    assert w.tolist() == trace.mean_field["attn"].windows[-1][0, 0].double().tolist()
    c = sa.models.cross_attention(8, 8, heads=1, dtype=f64)
    q, k = torch.randn(1, 40, 8, dtype=f64) * 3, torch.randn(1, 30, 8, dtype=f64) * 3
    fig = sa.plot_attention(c, q, k)
    _, P = sa.compile(c)(q, k, return_posterior=True)
    bars = [p.get_height() for p in _panels(fig)[1].patches]  # the attention each key receives
    assert bars == pytest.approx((P[0, 0].sum(0) / 40).tolist(), abs=1e-12)
    assert "attention each parent receives" in _panels(fig)[1].get_title()


def test_declared_prior_and_bad_heads():
    m = sa.models.alibi_attention(8, heads=2)
    fig = sa.plot_attention(m)  # no inputs: the prior on example inputs
    assert "declared prior" in fig._suptitle.get_text()
    with pytest.raises(ValueError, match=r"plot_attention: head must be an int in \[0, 2\); "
                                         r"got 3"):
        sa.plot_attention(m, heads=3)
