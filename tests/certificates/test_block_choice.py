"""The key blocks certified (structattn/certificates/block_choice.py, through ``certify_blocks``) against the
fewest a reading that knew the true float64 posterior could read, on the inputs where bounds
are hard: sharp queries (W_q × 10) over i.i.d. tokens, and over tokens whose mean drifts along
the sequence, with a planted far match, under every prior that takes ``certificate="blocks"``
(ALiBi, FoX's forget gate) and the uniform causal prior:

- sound: no child's true posterior mass in the blocks skipped exceeds its bound, nor ε;
- tight: the fraction of (child block, earlier key block) pairs skipped is ≥ 90% of the
  oracle's: per child block, skip the earlier key blocks in increasing order of their largest
  true posterior mass over the block's children, while every child's skipped mass stays ≤ ε.
"""

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

import structattn as sa
from structattn.block_sparse import certify_blocks
from structattn.priors import ALiBi, ForgettingGate

HEADS, D_MODEL, D_K, SHARP = 4, 32, 8, 10.0


def _tokens(kind, n, gen):
    """``(N, d_model)`` float64: i.i.d. N(0, 1) tokens, or the same plus a mean that drifts
    (twice an AR(1) sequence of unit variance, correlation 0.99 a step)."""
    x = torch.randn(n, D_MODEL, generator=gen, dtype=torch.float64)
    if kind == "drifting":
        rho = 0.99
        mean = torch.empty(n, D_MODEL, dtype=torch.float64)
        mean[0] = torch.randn(D_MODEL, generator=gen, dtype=torch.float64)
        step = torch.randn(n, D_MODEL, generator=gen, dtype=torch.float64) * math.sqrt(1 - rho**2)
        for t in range(1, n):
            mean[t] = rho * mean[t - 1] + step[t]
        x = x + 2 * mean
    return x


def _inputs(prior, kind, n, seed):
    """``(a, b, scale, h)``: per head (H, N, d_k) queries 10× sharper than a layer's
    projections give, keys, and the prior's per-parent log term (None: uniform) from the
    prior's own ``terms``; the last token's match planted 3/4 of the sequence back."""
    gen = torch.Generator().manual_seed(seed)
    x = _tokens(kind, n, gen)
    W_q, W_k = (torch.randn(HEADS, D_MODEL, D_K, generator=gen, dtype=torch.float64)
                / math.sqrt(D_MODEL) for _ in range(2))
    a = SHARP * torch.einsum("nd,hdk->hnk", x, W_q)
    b = torch.einsum("nd,hdk->hnk", x, W_k)
    b[:, n - 1 - (3 * n) // 4] = 3 * a[:, -1] / SHARP  # a key aligned with the last query
    if prior == "alibi":
        h = ALiBi(HEADS, causal=True).terms(n, n, a.device)[1].double()
    elif prior == "forget":
        W_f = torch.randn(HEADS, D_MODEL, generator=gen, dtype=torch.float64) / math.sqrt(D_MODEL)
        log_f = F.logsigmoid(x @ W_f.T + 3.0).T  # (H, N), gates ≈ σ(3) as FoX starts
        h = ForgettingGate(log_f).terms(n, n, a.device)[1]
    else:
        h = None
    return a, b, 1 / math.sqrt(D_K), h


def _posterior(a, b, h, scale):
    """``(H, N, N)`` float64, softmax over j ≤ i of h_j + scale·⟨a_i, b_j⟩, from the formula."""
    n = a.shape[-2]
    s = scale * a.double() @ b.double().transpose(-1, -2)
    if h is not None:
        s = s + h.double().unsqueeze(-2)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.softmax(s.masked_fill(~causal, float("-inf")), -1)


def _oracle_skip(p, L, eps):
    """The fraction of (child block, earlier key block) pairs the oracle skips: per head and
    child block, the earlier key blocks in increasing order of their largest true mass over
    the block's children, skipped while every child's cumulative skipped mass stays ≤ eps."""
    H, n, _ = p.shape
    nb = n // L
    skipped = total = 0
    for g in range(H):
        mass = p[g].view(n, nb, L).sum(-1)  # (N, nb): each child's mass per key block
        for c in range(1, nb):
            rows = mass[c * L:(c + 1) * L, :c]  # (L, c)
            order = rows.amax(0).argsort()
            fits = (rows[:, order].cumsum(-1) <= eps).all(0)  # (c,)
            skipped += int(fits.long().cumprod(0).sum())
            total += c
    return skipped / total


def _check(a, b, h, scale, eps, L):
    """The certificate's soundness against the true posterior; ``(skipped, oracle)``."""
    cert = certify_blocks(a, b, scale, h, eps, block=L)
    p = _posterior(a, b, h, scale)
    n = a.shape[-2]
    blk = torch.arange(n) // L
    read = cert.read[..., blk, :][..., blk]
    skipped_mass = (p * ~read).sum(-1)  # (H, N)
    assert cert.certified and (cert.bound <= eps).all()
    assert (skipped_mass <= cert.bound + 1e-12).all(), (skipped_mass - cert.bound).max()
    assert (skipped_mass <= eps).all()  # 0 violations
    return cert.skipped, _oracle_skip(p, L, eps)


def test_the_priors_that_take_block_certificates_are_those_tested():
    """Every public prior whose constructor takes ``certificate`` is tested below; the
    generalised Gaussian and the beta-geometric refuse it."""
    takes = {name for name in dir(sa.priors)
             if inspect.isclass(cls := getattr(sa.priors, name))
             and issubclass(cls, sa.priors.Prior) and cls is not sa.priors.DistancePrior
             and "certificate" in inspect.signature(cls.__init__).parameters}
    assert takes == {"ALiBi", "ForgettingGate"}
    with pytest.raises(TypeError, match="certificate"):
        sa.priors.GeneralisedGaussian(0.0, 1.0, 2.0, tol=1e-4, certificate="blocks")
    with pytest.raises(TypeError, match="certificate"):
        sa.priors.BetaGeometric(tol=1e-4, certificate="blocks")


@pytest.mark.parametrize("prior", ["alibi", "forget", "uniform"])
@pytest.mark.parametrize("kind", ["iid", "drifting"])
@pytest.mark.parametrize("n, L, seed", [(512, 64, 0), (768, 32, 1), (1024, 32, 2)])
@torch.no_grad()
def test_sharp_queries_skip_nine_tenths_of_what_the_true_posterior_allows(prior, kind, n, L,
                                                                           seed):
    a, b, scale, h = _inputs(prior, kind, n, seed)
    skipped, oracle = _check(a, b, h, scale, 1e-4, L)
    assert skipped >= 0.9 * oracle, (skipped, oracle)


@pytest.mark.parametrize("prior", ["alibi", "forget"])
@pytest.mark.parametrize("kind", ["iid", "drifting"])
@torch.no_grad()
def test_float32_factors_skip_as_much_and_stay_sound(prior, kind):
    """Scored in float32, the products' rounding charged: still ≥ 90% of the oracle."""
    a, b, scale, h = _inputs(prior, kind, 640, 3)
    skipped, oracle = _check(a.float(), b.float(), h.float(), scale, 1e-4, 32)
    assert skipped >= 0.9 * oracle and oracle > 0.1, (skipped, oracle)


@pytest.mark.slow
@pytest.mark.parametrize("prior", ["alibi", "forget", "uniform"])
@pytest.mark.parametrize("kind", ["iid", "drifting"])
@torch.no_grad()
def test_at_4096_tokens(prior, kind):
    """N = 4,096, blocks of 64, ε = 1e-4, float32 factors (``bench_block_sparse.py
    --synthetic`` measures the same on ALiBi and FoX layers of d_model = 64)."""
    a, b, scale, h = _inputs(prior, kind, 4096, 0)
    skipped, oracle = _check(a.float(), b.float(), None if h is None else h.float(), scale,
                             1e-4, 64)
    assert skipped >= 0.9 * oracle, (skipped, oracle)
