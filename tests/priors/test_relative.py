"""Relative-position priors (RelativePosition, ALiBi): empty supports and NaN refused, −∞
offsets excluded like a mask, the log table built once per forward and fresh each forward."""

import contextlib

import pytest
import torch

import structattn as sa

from ..programs import one_family_program
from ..reference import softmax_attention


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("prior", [
    lambda: sa.priors.RelativePosition(torch.tensor([0.0, 0.0, float("-inf"), 0.0, 0.0],
                                                    dtype=torch.float64), causal=True),
    lambda: sa.priors.RelativePosition(torch.tensor([0.0, float("nan"), 0.0], dtype=torch.float64)),
    lambda: sa.priors.ALiBi(1, slopes=torch.tensor([float("inf")])),
])
def test_relative_priors_refuse_empty_supports_and_nan(prior):
    program, _ = one_family_program(prior)
    with pytest.raises(ValueError, match=r"(edge family 'attn': (child 0 .*empty support|prior log "
                                         r"weights .*non-finite)|ALiBi prior: slopes .* finite)"):
        sa.compile(program)(_x(1, 5, 4))


TOL = 1e-6


def test_relative_prior_neg_inf_excludes_offsets_like_a_mask():
    lg = torch.tensor([0.3, float("-inf"), 0.0, -0.2, 0.5], dtype=torch.float64)  # i − j = −1 out
    program, W = one_family_program(lambda: sa.priors.RelativePosition(lg))
    x = _x(2, 5, 4)
    off = torch.arange(5)[:, None] - torch.arange(5)[None, :]
    bias = lg[off.clamp(-2, 2) + 2]
    ref, _ = softmax_attention(W[0], W[1], W[2], None, x, x, 1, bias=bias.masked_fill(
        bias.isneginf(), 0), mask=~bias.isneginf())
    torch.testing.assert_close(sa.compile(program)(x)[:, 0], ref, atol=TOL, rtol=0)
    assert sa.inference.compare(program, x).max_abs_diff < TOL


@pytest.mark.parametrize("hook", ["log_table", "log_at_offsets"])
def test_prior_table_is_built_once_per_forward_and_fresh_each_forward(hook):
    """The dense reading's table (kernels off), and the table over the offsets the CPU kernel
    reads (kernels on): each built once per forward, from the current logits."""
    calls = []

    class CountingRelative(sa.priors.RelativePosition):
        def log_table(self, *args):
            calls.append("log_table")
            return super().log_table(*args)

        def log_at_offsets(self, *args):
            calls.append("log_at_offsets")
            return super().log_at_offsets(*args)

    logits = torch.nn.Parameter(torch.randn(2, 5, dtype=torch.float64))
    prior = CountingRelative(logits, causal=True)  # one object reused across steps
    program, _ = one_family_program(lambda: prior, heads=2)
    layer = sa.compile(program)
    opt = torch.optim.SGD([logits], lr=0.5)
    x = _x(2, 6, 4)
    outs = []
    for _ in range(2):
        calls.clear()
        with sa.kernels.disabled() if hook == "log_table" else contextlib.nullcontext():
            out = layer(x)
        assert calls.count(hook) == 1
        out.square().sum().backward()  # a second step must not reuse the freed graph
        opt.step()
        opt.zero_grad()
        outs.append(out.detach())
    assert not torch.allclose(outs[0], outs[1])  # the updated logits were used
