"""A growing cache's step: the rotary angles from the table equal the full forward's bit for
bit, and the one-SDPA-call reading of even rows equals the general reading."""

import pytest
import torch

import structattn as sa
from structattn.decoding.project import rotated


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dims", [None, 4])
def test_rotation_from_the_table_is_the_positions_own(dtype, dims):
    model = sa.models.rope_attention(16, heads=2, rope_base=100.0, rope_dims=dims, dtype=dtype)
    q, k = torch.randn(2, 3, 2, 5, 8, dtype=dtype)
    pos = torch.randint(0, 300, (3, 5))
    computed = rotated(model, q, k, pos)
    looked_up = rotated(model, q, k, pos, upto=300)
    assert torch.equal(computed[0], looked_up[0]) and torch.equal(computed[1], looked_up[1])


@pytest.mark.parametrize("name", ["rope_attention", "alibi_attention", "forgetting_attention",
                                  "generalised_gaussian_attention"])
def test_even_rows_read_as_one_sdpa_call_equal_the_general_reading(name):
    layer = sa.compile(getattr(sa.models, name)(12, heads=3, dtype=torch.float64))
    x = torch.randn(2, 9, 12, dtype=torch.float64)
    fast, general = layer.new_cache(), layer.new_cache()
    general.rows_even = False  # as after a call with lengths=: the general reading
    for lo, hi in ((0, 5), (5, 6), (6, 9)):
        a = layer(x[:, lo:hi], cache=fast)
        b = layer(x[:, lo:hi], cache=general)
        assert (a - b).abs().max() < 1e-13
    assert fast.rows_even and fast.keys_read == 9
    assert (torch.cat([layer(x[:, :5], cache=(c := layer.new_cache())),
                       layer(x[:, 5:], cache=c)], 1) - layer(x)).abs().max() < 1e-12
