"""What every prior's tables must satisfy: they broadcast to (*batch, heads, children, parents)."""

import pytest
import torch

import structattn as sa


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def _program(prior_fn, heads=1, d=4, value=None):
    g = torch.Generator().manual_seed(7)
    W = [torch.randn(heads * 2, d, generator=g, dtype=torch.float64) for _ in range(3)]

    def program(x, *extra):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, prior_fn(*extra), heads=heads)
        sa.potential(phi, sa.potentials.Bilinear(W[0], W[1], heads=heads))
        v = sa.values.Linear(W[2], heads=heads) if value is None else value(W[2], heads)
        return sa.value(phi, v)
    return program, W


@pytest.mark.parametrize("case", ["mask3d-heads1", "alibi-heads", "relative-heads", "cat-batch"])
def test_prior_tables_must_broadcast_to_batch_heads(case):
    heads = 1 if case in ("mask3d-heads1", "relative-heads") else 2
    prior = {
        "mask3d-heads1": lambda: sa.priors.Uniform(support=torch.ones(3, 5, 5, dtype=torch.bool)),
        "alibi-heads": lambda: sa.priors.ALiBi(4),
        "relative-heads": lambda: sa.priors.RelativePosition(torch.randn(3, 5, dtype=torch.float64)),
        "cat-batch": lambda: sa.priors.Categorical(torch.randn(3, 5, 5, dtype=torch.float64)),
    }[case]
    program, _ = _program(prior, heads=heads)
    with pytest.raises(ValueError, match=r"edge family 'attn': prior (support mask|log weights) "
                                         r"must broadcast to \(\*batch, heads, children, parents\)"):
        sa.compile(program)(_x(2, 5, 4))
