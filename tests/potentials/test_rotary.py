"""Rotary positions (structattn/potentials/rotary.py): the rotation equals RoPE as its common
implementations write it (GPT-NeoX / LLaMA's "rotate half", the same frequencies); ψ depends
on the positions through j − i only; under every prior it takes, the compiled layer equals
Pyro's enumeration of the definition (complex form, not the factors); bad arguments refused.
The catalogue's rope_attention (and its partial-rotary variant) is covered by the generic
catalogue tests: Pyro, gradcheck, replay, dtypes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import structattn as sa

f64 = torch.float64


def reference_rope(x, positions, base, dims):
    """RoPE as GPT-NeoX and LLaMA's common implementations apply it to a head's states
    ``(…, n, d)``: inv_freq = 1 / base^(arange(0, dims, 2) / dims), freqs = positions ⊗
    inv_freq, emb = cat(freqs, freqs), x·cos(emb) + rotate_half(x)·sin(emb) on the first
    ``dims`` dimensions, rotate_half(x) = cat(−x2, x1); the rest passes through."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dims, 2, dtype=f64) / dims))
    freqs = torch.outer(positions.to(f64), inv_freq)
    emb = torch.cat([freqs, freqs], -1)
    r, rest = x[..., :dims], x[..., dims:]
    x1, x2 = r[..., :dims // 2], r[..., dims // 2:]
    rotated = r * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()
    return torch.cat([rotated, rest], -1)


@pytest.mark.parametrize("dims", [None, 2])
def test_the_rotation_is_rope_as_common_implementations_write_it(dims):
    torch.manual_seed(0)
    W_q, W_k = torch.randn(8, 5, dtype=f64), torch.randn(8, 5, dtype=f64)
    psi = sa.potentials.Rotary(W_q, W_k, heads=2, base=500.0, dims=dims)
    x = torch.randn(3, 7, 5, dtype=f64)
    want_dims = 4 if dims is None else dims
    for got, W in ((psi.child_factor(x), W_q), (psi.parent_factor(x), W_k)):
        plain = (x @ W.T).unflatten(-1, (2, 4)).transpose(-2, -3)  # (3, 2, 7, 4)
        want = reference_rope(plain, torch.arange(7), 500.0, want_dims)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_the_score_depends_on_the_positions_only_through_their_difference():
    torch.manual_seed(1)
    W_q, W_k = torch.randn(4, 6, dtype=f64), torch.randn(4, 6, dtype=f64)
    x = torch.randn(2, 5, 6, dtype=f64)
    table = sa.potentials.Rotary(W_q, W_k, base=50.0).pairwise(x, x)
    for shift in (3, 1000):
        pos = torch.arange(5) + shift
        moved = sa.potentials.Rotary(W_q, W_k, base=50.0, child_positions=pos,
                                     parent_positions=pos).pairwise(x, x)
        torch.testing.assert_close(moved, table, rtol=0, atol=1e-10)
    # and they do matter: the same states at other offsets score differently
    other = sa.potentials.Rotary(W_q, W_k, base=50.0, child_positions=torch.arange(5) + 2)
    assert (other.pairwise(x, x) - table).abs().max() > 1e-3


PRIORS = ["self_attention", "alibi_attention", "forgetting_attention", "stick_breaking_attention",
          "relative_position_attention"]


@settings(max_examples=12, deadline=None)
@given(model=st.sampled_from(PRIORS), n=st.integers(1, 6), heads=st.integers(1, 2),
       dims=st.sampled_from([None, 2]), base=st.floats(2.0, 1e4), seed=st.integers(0, 10_000))
def test_rotary_under_every_prior_equals_pyro_enumerating_the_definition(model, n, heads, dims,
                                                                       base, seed):
    torch.manual_seed(seed)
    kwargs = dict(heads=heads, d_k=4, rope_base=base, rope_dims=dims, dtype=f64)
    if model == "self_attention":
        kwargs["causal"] = bool(seed % 2)
    m = getattr(sa.models, model)(8, **kwargs)
    x = torch.randn(2, n, 8, dtype=f64) * 1.5
    report = sa.inference.compare(m, x)
    assert report.passed and report.max_abs_diff < 1e-10, report


def test_expanding_attention_takes_rotary_positions_too():
    torch.manual_seed(2)
    m = sa.models.expanding_attention(8, heads=2, d_k=4, inference=None, rope_base=100.0,
                                      dtype=f64)
    report = sa.inference.compare(m, torch.randn(1, 6, 8, dtype=f64))
    assert report.passed and report.max_abs_diff < 1e-10, report


@pytest.mark.parametrize("kwargs, match", [
    (dict(base=1.0), r"Rotary potential: base .* must be a finite number > 1; got 1.0"),
    (dict(base=float("nan")), r"base .* got nan"),
    (dict(base="10000"), r"base .* got '10000'"),
    (dict(dims=3), r"dims .* must be even and ≤ d_k=4; got 3"),
    (dict(dims=6), r"dims .* must be even and ≤ d_k=4; got 6"),
    (dict(dims=0), r"Rotary potential: dims must be a positive int; got 0"),
])
def test_bad_rotary_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sa.potentials.Rotary(torch.randn(8, 5), torch.randn(8, 5), heads=2, **kwargs)


def test_the_models_refuse_rope_dims_without_rope_base_and_check_positions():
    with pytest.raises(ValueError, match=r"SelfAttention: rope_dims=2 needs rope_base"):
        sa.models.self_attention(8, heads=2, rope_dims=2)
    with pytest.raises(ValueError, match=r"ForgettingAttention.*|Rotary potential: dims"):
        sa.models.forgetting_attention(8, heads=2, rope_base=100.0, rope_dims=5)
    psi = sa.potentials.Rotary(torch.randn(4, 6), torch.randn(4, 6), base=10.0,
                               child_positions=torch.arange(3))

    def program(x):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, sa.priors.Uniform())
        sa.potential(phi, psi)
        return sa.value(phi, sa.values.Linear(torch.randn(4, 6)))

    with pytest.raises(ValueError, match=r"rotary child_positions must be a tensor \(5,\)"):
        sa.compile(program)(torch.randn(1, 5, 6))


def test_a_wrong_rotation_fails_compare(monkeypatch):
    """The oracle evaluates ψ from its definition (complex form): a rotation planted with the
    wrong angle, or no rotation, in the factors' reading is caught."""
    torch.manual_seed(3)
    m = sa.models.rope_attention(8, heads=2, d_k=4, rope_base=100.0, dtype=f64)
    x = torch.randn(2, 6, 8, dtype=f64)
    assert sa.inference.compare(m, x).passed
    right = sa.potentials.Rotary.rotate

    def one_percent_off(self, x, positions=None, inverse=False):
        p = torch.arange(x.shape[-2], dtype=f64) if positions is None else positions.to(f64)
        return right(self, x, p * 1.01, inverse=inverse)

    monkeypatch.setattr(sa.potentials.Rotary, "rotate", one_percent_off)
    assert not sa.inference.compare(m, x).passed
    monkeypatch.setattr(sa.potentials.Rotary, "rotate",
                        lambda self, x, positions=None, inverse=False: x)
    assert not sa.inference.compare(m, x).passed
