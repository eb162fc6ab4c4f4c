"""The cost model's cheapest evidence (``certificates.sampled.sampled_widths``): for each head, the
narrowest width at which its sampled children's bound, taken with their exact evidence,
is ≤ eps. Checked against a brute force in float64 over every child of the second half,
for a per-parent prior term (FoX, ALiBi) and a prior by distance (the generalised Gaussian),
and against what a reading certifies: no head's reading is narrower."""

import math

import pytest
import torch

from structattn.certificates.certified_read import certified_band_attention, widths_from
from structattn.certificates.sampled import sampled_widths

f64 = torch.float64


def _brute(a, b, scale, eps, widths, log_prior, first):
    """Each head's narrowest width in ``widths`` certifying children N/2 … N − 1 with their
    exact evidence: σ(log T + S − log I), summed term by term."""
    H, n, _ = a.shape
    out = []
    for g in range(H):
        chosen = widths[-1]
        for w in widths:
            ok = True
            for c in range(n // 2, n):
                parents = range(0, c - first + 1)
                inside = [j for j in parents if j >= c - w]
                beyond = [j for j in parents if j < c - w]
                if not beyond:
                    continue
                score = [scale * float(a[g, c] @ b[g, j]) + log_prior(g, c, j) for j in inside]
                log_in = math.log(sum(math.exp(s) for s in score))
                log_tail = math.log(sum(math.exp(log_prior(g, c, j)) for j in beyond))
                ceiling = abs(scale) * float(a[g, c].norm()) * max(float(b[g, j].norm())
                                                                     for j in beyond)
                bound = 1 / (1 + math.exp(-(log_tail + ceiling - log_in)))
                if bound > eps:
                    ok = False
                    break
            if ok:
                chosen = w
                break
        out.append(chosen)
    return out


@pytest.mark.parametrize("seed,n,sharp", [(0, 40, 0.5), (1, 64, 0.2), (2, 97, 1.0), (3, 80, 0.05)])
def test_a_per_parent_term_matches_the_brute_force(seed, n, sharp):
    g = torch.Generator().manual_seed(seed)
    H, k, eps = 3, 4, 1e-3
    a, b = (torch.randn(H, n, k, generator=g, dtype=f64) * 0.5 for _ in range(2))
    h = sharp * torch.arange(n, dtype=f64) * torch.tensor([1.0, 0.5, 2.0], dtype=f64)[:, None]
    widths = widths_from(n - 1, 2, None)
    got = sampled_widths(a, b, h, 0.7, (H,), torch.tensor(widths), eps, per_row=n - n // 2)
    want = _brute(a, b, 0.7, eps, widths, lambda g_, c, j: float(h[g_, j]), 0)
    assert got.tolist() == want


@pytest.mark.parametrize("seed,n,first", [(0, 50, 1), (1, 73, 0), (2, 64, 1)])
def test_a_prior_by_distance_matches_the_brute_force(seed, n, first):
    g = torch.Generator().manual_seed(seed)
    H, k, eps = 2, 4, 1e-3
    a, b = (torch.randn(H, n, k, generator=g, dtype=f64) * 0.5 for _ in range(2))
    d = torch.arange(n, dtype=f64)
    table = torch.stack([-(d / 3) ** 2, -(d / 9) ** 1.5])  # (H, n): log weight at distance d
    widths = widths_from(n - 1, 2, None)
    got = sampled_widths(a, b, None, -0.4, (H,), torch.tensor(widths), eps, first=first,
                         table=table, per_row=n - n // 2)
    want = _brute(a, b, -0.4, eps, widths, lambda g_, c, j: float(table[g_, c - j]), first)
    assert got.tolist() == want


@pytest.mark.parametrize("seed", range(4))
def test_no_reading_certifies_a_head_narrower_than_its_sampled_width(seed):
    g = torch.Generator().manual_seed(seed)
    H, n, k, eps = 4, 256, 8, 1e-4
    a, b, u = (torch.randn(1, H, n, k, generator=g, dtype=f64) for _ in range(3))
    h = (torch.rand(1, H, 1, generator=g, dtype=f64) * 0.6) * torch.arange(n, dtype=f64)
    widths = torch.tensor(widths_from(n - 1, 16, None))
    sampled = sampled_widths(a, b, h, 0.35, (1, H), widths, eps)
    out, choice = certified_band_attention(a, b, u, 0.35, h, eps)  # (no cost rule: read)
    assert bool((choice.heads.reshape(-1) >= sampled).all())
    assert bool((choice.bound <= eps).all())


def test_a_sample_that_no_band_could_certify_reads_the_whole_past_without_a_band():
    """Spread scores (ALiBi on large tokens): the best scores would allow a band, the sampled
    children's exact evidence none — the cost rule reads the whole past at once."""
    g = torch.Generator().manual_seed(0)
    H, n, k = 2, 512, 8
    a, b, u = (torch.randn(1, H, n, k, generator=g, dtype=f64) * 4 for _ in range(3))
    h = 0.02 * torch.arange(n, dtype=f64).expand(1, H, n)
    reads, wholes = [], []

    def read(*args):
        reads.append(args)
        raise AssertionError("a band was read")

    def whole(a, b, u, h, scale):
        wholes.append(1)
        s = scale * a @ b.transpose(-1, -2) + h[..., None, :]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(s, -1) @ u

    widths = torch.tensor(widths_from(n - 1, 16, 2 * n // 5))
    assert sampled_widths(a, b, h, 0.35, (1, H), widths, 1e-4).tolist() == [n - 1] * H
    out, choice = certified_band_attention(a, b, u, 0.35, h, 1e-4, read=read, whole_past=whole,
                                           widest=2 * n // 5, pays=lambda w, n_, k_: bool(
                                               (w < n_ - 1).all()))
    assert not reads and wholes == [1] and choice.skipped == 0 and bool((choice.bound == 0).all())


@pytest.mark.parametrize("n", [9, 40, 70])
def test_the_last_childs_width_is_where_its_exact_mass_beyond_falls_under_eps(n):
    """``last_child_widths`` against its definition summed term by term in float64: the
    posterior of child N − 1 over parents j ≤ N − 1 ∝ exp(scale·a·b_j + h_j), its mass on
    j ≤ N − 2 − w; the narrowest width with that ≤ eps."""
    from structattn.certificates.sampled import last_child_widths

    g = torch.Generator().manual_seed(n)
    a, b = (torch.randn(2, 3, n, 5, generator=g, dtype=f64) for _ in range(2))
    slopes = torch.tensor([0.05, 0.5, 3.0], dtype=f64)[:, None]  # a slow head, a sharp one
    h = -(slopes * torch.arange(n, dtype=f64).flip(0))[None]  # (1, 3, N): ALiBi's, per head
    widths = widths_from(n - 1, 2, None)
    eps = 1e-3
    got = last_child_widths(a, b, h, 0.7, (2, 3), torch.tensor(widths), eps)
    want = []
    for i in range(2):
        for j in range(3):
            w = [math.exp(0.7 * float(a[i, j, -1] @ b[i, j, p]) + float(h[0, j, p]))
                 for p in range(n)]
            want.append(next(v for v in widths if sum(w[:max(0, n - 1 - v)]) <= eps * sum(w)))
    assert got.tolist() == want
    assert len(set(want)) > 1  # (the rows differ: the test can tell them apart)


@pytest.mark.parametrize("first", [0, 1])
def test_the_last_childs_width_under_a_prior_by_distance(first):
    """The same with a prior by distance (``table``, the generalised Gaussian's) and the
    nearest distance read ``first``: against the definition summed term by term."""
    from structattn.certificates.sampled import last_child_widths

    n, eps = 50, 1e-3
    g = torch.Generator().manual_seed(first)
    a, b = (torch.randn(1, 3, n, 4, generator=g, dtype=f64) for _ in range(2))
    d = torch.arange(n, dtype=f64)
    table = -(d / torch.tensor([[2.0], [8.0], [60.0]], dtype=f64)) ** 2  # (3, N): w(d)
    widths = widths_from(n - 1, 2, None)
    got = last_child_widths(a, b, None, 0.5, (1, 3), torch.tensor(widths), eps, first=first,
                            table=table)
    want = []
    for j in range(3):
        w = [math.exp(0.5 * float(a[0, j, -1] @ b[0, j, p]) + float(table[j, n - 1 - p]))
             for p in range(n - first)]
        want.append(next(v for v in widths if sum(w[:max(0, n - 1 - v)]) <= eps * sum(w)))
    assert got.tolist() == want and len(set(want)) > 1
