"""What every prior's tables must satisfy: they broadcast to (*batch, heads, children, parents)."""

import pytest
import torch

import structattn as sa

from ..programs import one_family_program


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("case", ["mask3d-heads1", "alibi-heads", "relative-heads", "cat-batch"])
def test_prior_tables_must_broadcast_to_batch_heads(case):
    heads = 1 if case in ("mask3d-heads1", "relative-heads") else 2
    prior = {
        "mask3d-heads1": lambda: sa.priors.Uniform(support=torch.ones(3, 5, 5, dtype=torch.bool)),
        "alibi-heads": lambda: sa.priors.ALiBi(4),
        "relative-heads": lambda: sa.priors.RelativePosition(torch.randn(3, 5, dtype=torch.float64)),
        "cat-batch": lambda: sa.priors.Categorical(torch.randn(3, 5, 5, dtype=torch.float64)),
    }[case]
    program, _ = one_family_program(prior, heads=heads)
    with pytest.raises(ValueError, match=r"edge family 'attn': prior (support mask|log weights) "
                                         r"must broadcast to \(\*batch, heads, children, parents\)"):
        sa.compile(program)(_x(2, 5, 4))
