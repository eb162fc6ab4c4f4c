"""The generalised Gaussian over distance (BAM): β = 1 is ALiBi's Laplace prior, β = 2 a
Gaussian; gradients stay finite where the distance equals the location (β < 1); bad
parameters are refused naming them."""

import math

import pytest
import torch

import structattn as sa
from structattn.kinds.base import grid

f64 = torch.float64


@pytest.mark.parametrize("causal", [True, False])
def test_shape_one_at_zero_location_is_alibi(causal):
    torch.manual_seed(0)
    H, slopes = 3, torch.tensor([0.5, 0.1, 1.3], dtype=f64)
    gg = sa.models.generalised_gaussian_attention(12, heads=H, causal=causal, dtype=f64)
    alibi = sa.models.alibi_attention(12, heads=H, causal=causal, dtype=f64)
    with torch.no_grad():
        for name in ("W_q", "W_k", "W_v", "W_o"):
            getattr(alibi, name).copy_(getattr(gg, name))
        gg.loc.zero_()
        gg.log_scale.copy_(slopes.log())
        gg.log_shape.zero_()
        alibi.slopes.copy_(slopes)
    x = torch.randn(2, 9, 12, dtype=f64)
    y_gg, p_gg = sa.compile(gg)(x, return_posterior=True)
    y_alibi, p_alibi = sa.compile(alibi)(x, return_posterior=True)
    torch.testing.assert_close(y_gg, y_alibi, rtol=0, atol=1e-12)
    torch.testing.assert_close(p_gg, p_alibi, rtol=0, atol=1e-12)


def test_shape_two_is_a_gaussian_over_the_distance():
    loc, log_scale = torch.tensor([1.5, -2.0], dtype=f64), torch.tensor([-1.0, 0.3], dtype=f64)
    prior = sa.priors.GeneralisedGaussian(loc, log_scale, torch.full((2,), 2.0, dtype=f64),
                                          causal=False)
    i, j = grid(6, 6, "cpu")
    d = (i - j).to(f64)
    want = -(((d - loc[:, None, None]) * log_scale.exp()[:, None, None]) ** 2)
    torch.testing.assert_close(prior.log_weight(i, j, (6, 6)), want, rtol=0, atol=1e-12)


def test_gradients_are_finite_where_the_distance_is_the_location():
    loc = torch.zeros(2, dtype=f64, requires_grad=True)  # i − j − μ = 0 on the diagonal
    log_scale = torch.zeros(2, dtype=f64, requires_grad=True)
    shape = torch.tensor([0.5, 1.5], dtype=f64, requires_grad=True)
    prior = sa.priors.GeneralisedGaussian(loc, log_scale, shape)
    i, j = grid(5, 5, "cpu")
    prior.log_weight(i, j, (5, 5))[..., j <= i].sum().backward()
    for t in (loc, log_scale, shape):
        assert torch.isfinite(t.grad).all(), t.grad


@pytest.mark.parametrize("kwargs, match", [
    (dict(shape=torch.tensor([1.0, 0.0])), r"shape β must be finite and > 0 .* got \[1\.0, 0\.0\]"),
    (dict(shape=-1.0), r"shape β must be finite and > 0"),
    (dict(loc=torch.tensor([math.nan])), r"loc must be finite; got \[nan\]"),
    (dict(log_scale=torch.ones(2, 2)), r"log_scale must be a float scalar or a 1-D tensor \(heads,\); "
                                       r"got \(2, 2\)"),
])
def test_bad_parameters_are_refused(kwargs, match):
    args = dict(loc=0.0, log_scale=0.0, shape=1.0) | kwargs
    with pytest.raises(ValueError, match=match):
        sa.priors.GeneralisedGaussian(**args)


@pytest.mark.parametrize("kwargs, match", [(dict(width=0), r"width must be a finite number > 0"),
                                           (dict(shape=-2), r"shape must be a finite number > 0")])
def test_factory_refuses_bad_initial_prior(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sa.models.generalised_gaussian_attention(8, **kwargs)


def test_the_per_head_table_reaches_sdpa_with_the_queries_rank(monkeypatch):
    """The dense reading hands SDPA the (heads, C, P) table as a (1, heads, C, P) view: the
    CPU's fused kernel takes a 2-D or 4-D mask only, and a 3-D one would send SDPA to its math
    path (the C×P scores and their softmax in memory)."""
    from structattn.kinds import dense

    ranks, real = [], dense.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        ranks.append((q.dim(), None if attn_mask is None else attn_mask.dim()))
        return real(q, k, v, attn_mask=attn_mask, **kw)
    layer = sa.compile(sa.models.generalised_gaussian_attention(12, heads=3, dtype=f64),
                       replay=False)
    monkeypatch.setattr(dense.F, "scaled_dot_product_attention", spy)
    with torch.no_grad(), sa.kernels.disabled():  # the dense reading (the CPU kernel reads
        layer(torch.randn(2, 9, 12, dtype=f64))  # the distance table per tile)
    assert ranks == [(4, 4)]
