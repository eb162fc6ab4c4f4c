"""What a newcomer met (issue: drawings and newcomers): each point pinned where it is behaviour."""

import pytest
import torch

import structattn as sa

f64 = torch.float64


def test_a_batched_table_without_heads_points_to_edges_heads():
    W = torch.randn(4, 4)
    logits = torch.randn(2, 3, 5)  # (*batch, C, P): the heads dim is missing

    def program(q, k):
        phi = sa.edges("a", sa.nodes("q", q), sa.nodes("k", k), sa.priors.Categorical(logits))
        sa.potential(phi, sa.potentials.Bilinear(W, W))
        return sa.value(phi, sa.values.Linear(W))

    with pytest.raises(ValueError, match=r"heads dim too.*structattn.edges\(\.\.\., heads=H\)"):
        sa.compile(program)(torch.randn(2, 3, 4), torch.randn(2, 5, 4))


def _categorical_program(logits, empty):
    W = torch.randn(4, 4, dtype=f64, generator=torch.Generator().manual_seed(0))

    def program(q, k):
        phi = sa.edges("a", sa.nodes("q", q), sa.nodes("k", k),
                       sa.priors.Categorical(logits, empty=empty))
        sa.potential(phi, sa.potentials.Bilinear(W, W))
        return sa.value(phi, sa.values.Linear(W))
    return program


def test_categorical_takes_empty_zero_and_both_paths_agree_unchecked():
    logits = torch.randn(3, 5, dtype=f64)
    logits[1] = float("-inf")  # child 1 has no allowed parent
    q, k = torch.randn(2, 3, 4, dtype=f64), torch.randn(2, 5, 4, dtype=f64)
    zero = _categorical_program(logits, "zero")
    out, post = sa.compile(zero)(q, k, return_posterior=True)
    assert out[:, :, 1].abs().max() == 0 and post[:, :, 1].abs().max() == 0
    assert sa.inference.compare(zero, q, k).passed
    refused = _categorical_program(logits, "error")
    with pytest.raises(ValueError, match="empty support"):
        sa.compile(refused)(q, k)
    with sa.validation(False):  # unchecked: zeros on both paths, never NaN on one of them
        plain = sa.compile(refused)(q, k)
        dense, post = sa.compile(refused)(q, k, return_posterior=True)
    assert torch.isfinite(post).all() and torch.isfinite(dense).all()
    torch.testing.assert_close(plain, dense)
    with pytest.raises(ValueError, match="empty must be"):
        sa.priors.Categorical(logits, empty="skip")


@pytest.mark.parametrize("build", [lambda: sa.models.self_attention(64, heads=5),
                                   lambda: sa.models.cross_attention(10, heads=3),
                                   lambda: sa.models.hopfield(10, heads=4)])
def test_heads_that_do_not_divide_the_width_are_refused(build):
    with pytest.raises(ValueError, match="not divisible by heads=.*give d_k"):
        build()
    assert sa.models.self_attention(64, heads=5, d_k=12).d_k == 12


def test_float16_runs():
    m = sa.models.self_attention(8, heads=2).to(torch.float16)
    y = sa.compile(m)(torch.randn(2, 5, 8, dtype=torch.float16))
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
