"""An output that gains batch dims neither an input nor a value has (a value broadcast
without ``merge_heads``) is refused in one line naming ``merge_heads``, in every reading."""

import pytest
import torch

import structattn as sa

f64 = torch.float64
W = torch.randn(6, 6, dtype=f64)


def _program(merge: bool, heads: int = 1):
    def program(x):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, sa.priors.Uniform(), heads=heads)
        sa.potential(phi, sa.potentials.Bilinear(W, W))
        v = sa.value(phi, sa.values.Linear(W))  # (*batch, H, C, d_v)
        return x + (sa.merge_heads(v) if merge else v)
    return program


MESSAGE = (r"^program: the output \(2, 2, 9, 6\) has batch dims \(2, 2\) that no input \(batch "
           r"\[\(2,\)\]\) and no family or value \(\(\*batch\[, heads\]\) \[\(2,\), \(2, 1\)\]\) has: "
           r".* merge its "
           r"heads first, structattn\.merge_heads\(structattn\.value\(…\)\) → \(\*batch, "
           r"children, heads·d_v\)$")


@pytest.mark.parametrize("reading", ["compiled", "exact", "sample", "compare"])
def test_a_value_broadcast_against_the_batch_is_refused(reading):
    x = torch.randn(2, 9, 6, dtype=f64)
    run = {"compiled": lambda p: sa.compile(p)(x),
           "exact": lambda p: sa.inference.exact(p, x),
           "sample": lambda p: sa.inference.sample(p, x, num_samples=2),
           "compare": lambda p: sa.inference.compare(p, x)}[reading]
    with pytest.raises(ValueError, match=MESSAGE) as err:
        run(_program(merge=False))
    assert "\n" not in str(err.value)
    run(_program(merge=True))  # merged: (2, 9, 6), accepted


def test_values_with_their_heads_and_size_one_batches_are_accepted():
    """A value returned whole keeps the (*batch, H) dims of its own; a batch of one mixes
    nothing."""

    def heads(x):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.DotProduct())
        return sa.value(phi, sa.values.Identity())

    x = torch.randn(2, 9, 6, dtype=f64)
    assert sa.compile(heads)(x).shape == (2, 1, 9, 6)
    assert sa.inference.exact(heads, x).output.shape == (2, 1, 9, 6)
    one = torch.randn(1, 9, 6, dtype=f64)
    assert sa.compile(_program(merge=False))(one).shape == (1, 1, 9, 6)
