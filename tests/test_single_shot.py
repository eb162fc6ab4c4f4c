"""Mechanism-specific checks of the single-shot catalogue against independent references."""

import math

import pytest
import torch
import torch.nn.functional as F

import structattn as sa

from .reference import heads_of, softmax_attention

TOL = 1e-6


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


# -- relative positions and ALiBi ---------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_relative_position_bias_is_clipped_offset_table(causal):
    m = sa.models.relative_position_attention(7, max_distance=2, d_k=3, heads=2, causal=causal,
                                              dtype=torch.float64)
    with torch.no_grad():
        m.position_logits.normal_()
    n = 6
    bias = torch.empty(2, n, n, dtype=torch.float64)
    for h in range(2):
        for i in range(n):
            for j in range(n):
                bias[h, i, j] = m.position_logits[h, max(-2, min(2, i - j)) + 2]
    x = _x(3, n, 7)
    ref, p_ref = softmax_attention(m.W_q, m.W_k, m.W_v, m.W_o, x, x, 2, bias=bias, causal=causal)
    y, post = sa.compile(m)(x, return_posterior=True)
    torch.testing.assert_close(sa.compile(m)(x), ref, atol=TOL, rtol=0)
    torch.testing.assert_close(post, p_ref.expand_as(post), atol=TOL, rtol=0)
    assert sa.inference.compare(m, x).max_abs_diff < TOL
    sa.compile(m)(x).sum().backward()
    assert m.position_logits.grad.abs().sum() > 0


def test_alibi_is_a_relative_position_prior_with_fixed_slopes():
    m = sa.models.alibi_attention(8, d_k=2, heads=4, causal=True, dtype=torch.float64)
    n = 5
    slopes = torch.tensor([2 ** (-8 * (h + 1) / 4) for h in range(4)], dtype=torch.float64)
    logits = -slopes[:, None] * torch.arange(-(n - 1), n, dtype=torch.float64).abs()
    x = _x(2, n, 8)
    y = sa.compile(m)(x)
    rel = sa.models.relative_position_attention(8, max_distance=n - 1, d_k=2, heads=4, causal=True,
                                                dtype=torch.float64)
    rel.load_state_dict({**m.state_dict(), "position_logits": logits}, strict=False)
    torch.testing.assert_close(y, sa.compile(rel)(x), atol=TOL, rtol=0)
    assert sa.inference.compare(m, x).max_abs_diff < TOL
    assert not any(p is m.slopes for p in m.parameters())  # fixed, a buffer


def test_relative_and_alibi_bad_input():
    with pytest.raises(ValueError, match=r"RelativePosition prior: logits must be .*\(2K\+1,\).*"
                                         r"\(2, 4\)"):
        sa.priors.RelativePosition(torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"ALiBi prior: slopes must be .* m ≥ 0"):
        sa.priors.ALiBi(2, slopes=torch.tensor([0.5, -1.0]))
    with pytest.raises(ValueError, match=r"max_distance must be an int ≥ 0"):
        sa.models.relative_position_attention(4, max_distance=-1)
    m = sa.models.relative_position_attention(4, max_distance=1, heads=2, d_k=2)
    with pytest.raises(ValueError, match=r"node set 'x'.*\(\*batch, n, 4\)"):
        sa.compile(m)(torch.randn(1, 3, 5))


# -- absolute positions --------------------------------------------------------------------

@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_absolute_positions_enter_the_potential_only(positions):
    m = sa.models.absolute_position_attention(6, max_len=9, positions=positions, d_k=3, heads=2,
                                              causal=True, dtype=torch.float64)
    x = _x(2, 5, 6)
    e = m.positions[:5]
    H = 2
    q, k = heads_of((x + e) @ m.W_q.T, H), heads_of((x + e) @ m.W_k.T, H)
    v = heads_of(x @ m.W_v.T, H)
    s = (q @ k.transpose(-1, -2) / math.sqrt(3)).masked_fill(
        ~torch.ones(5, 5, dtype=torch.bool).tril(), -math.inf)
    ref = (s.softmax(-1) @ v).transpose(-3, -2).flatten(-2) @ m.W_o.T
    torch.testing.assert_close(sa.compile(m)(x), ref, atol=TOL, rtol=0)
    assert sa.inference.compare(m, x).max_abs_diff < TOL


def test_sinusoidal_encodings():
    e = sa.potentials.sinusoidal(4, 6, dtype=torch.float64)
    assert e[0, 0] == 0 and e[0, 1] == 1
    torch.testing.assert_close(e[3, 2], torch.tensor(math.sin(3 / 10000 ** (2 / 6)),
                                                     dtype=torch.float64))


def test_absolute_positions_bad_input():
    m = sa.models.absolute_position_attention(6, max_len=4, d_k=3)
    with pytest.raises(ValueError, match=r"node set 'x' has 5 tokens .* max_len=4"):
        sa.compile(m)(torch.randn(1, 5, 6))
    with pytest.raises(ValueError, match=r"positions must be 'learned' or 'sinusoidal'"):
        sa.models.absolute_position_attention(6, positions="rotary")
    W = torch.randn(2, 3)

    def program(x):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.Positional(sa.potentials.Bilinear(W, W), torch.zeros(4, 3)))
        return sa.value(phi, sa.values.Linear(W))

    with pytest.raises(ValueError, match=r"edge family 'attn': positional encodings for children "
                                         r"'x' must have shape \(…, 5, 3\); got \(4, 3\)"):
        sa.compile(program)(torch.randn(1, 5, 3))


# -- classification ------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.3, "learned"])
def test_classification_posterior_is_softmax_and_nll_is_cross_entropy(temperature):
    m = sa.models.classification(6, 5, temperature=temperature, dtype=torch.float64)
    f = _x(4, 3, 6)
    labels = torch.randint(5, (4, 3))
    probs = m.class_probabilities(f)
    assert probs.shape == (4, 3, 5)
    tau = m.temperature
    logits = f @ m.class_embeddings.T / tau
    nll = -probs.gather(-1, labels[..., None]).log().mean()
    torch.testing.assert_close(nll, F.cross_entropy(logits.reshape(-1, 5), labels.reshape(-1)),
                               atol=1e-12, rtol=0)
    torch.testing.assert_close(sa.compile(m)(f), probs @ m.class_embeddings, atol=TOL, rtol=0)
    assert sa.inference.compare(m, f).max_abs_diff < TOL
    nll.backward()
    assert m.class_embeddings.grad.abs().sum() > 0
    if temperature == "learned":
        assert m.log_temperature.grad != 0


def test_classification_bad_input():
    m = sa.models.classification(6, 5)
    with pytest.raises(ValueError, match=r"node set 'outputs'.*\(\*batch, n, 6\).*\(2, 3, 4\)"):
        sa.compile(m)(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match=r"Classification: temperature must be a finite number > 0"):
        sa.models.classification(6, 5, temperature=0)


# -- temperature -----------------------------------------------------------------------------

def test_temperature_is_a_tempered_posterior():
    """p_τ(φ_i = j | x) ∝ p_1(φ_i = j | x)^(1/τ) under a uniform prior."""
    m1 = sa.models.self_attention(6, d_k=3, heads=2, temperature=1.0, dtype=torch.float64)
    m2 = sa.models.self_attention(6, d_k=3, heads=2, temperature=2.5, dtype=torch.float64)
    m2.load_state_dict(m1.state_dict())
    x = _x(2, 5, 6)
    _, p1 = sa.compile(m1)(x, return_posterior=True)
    _, p2 = sa.compile(m2)(x, return_posterior=True)
    tempered = p1 ** (1 / 2.5)
    torch.testing.assert_close(p2, tempered / tempered.sum(-1, keepdim=True), atol=1e-12, rtol=0)


def test_learned_temperature_gets_gradients_and_stays_positive():
    m = sa.models.self_attention(6, d_k=4, heads=2, temperature="learned", dtype=torch.float64)
    assert float(m.temperature.detach()) == pytest.approx(2.0)
    x = _x(2, 5, 6)
    sa.compile(m)(x).square().sum().backward()
    assert m.log_temperature.grad is not None and m.log_temperature.grad != 0
    assert sa.inference.compare(m, x).max_abs_diff < TOL
    with pytest.raises(ValueError, match=r"temperature must be a number > 0, a tensor, None .* "
                                         r"or 'learned'; got 'learn'"):
        sa.models.self_attention(6, temperature="learn")


# -- multihop --------------------------------------------------------------------------------

@pytest.mark.parametrize("weights", [(0, 1, 1), (1 / 3, 1 / 3, 1 / 3), (0.5, -1, 0, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_multihop_is_a_sum_of_matrix_powers(weights, causal):
    m = sa.models.multihop_attention(6, d_k=3, heads=2, hop_weights=weights, causal=causal,
                                     dtype=torch.float64)
    x = _x(2, 4, 6)
    _, P = softmax_attention(m.W_q, m.W_k, m.W_v, None, x, x, 2, causal=causal)
    V = heads_of(x @ m.W_v.T, 2)
    ref = sum(w * torch.linalg.matrix_power(P, k) @ V for k, w in enumerate(weights))
    ref = ref.transpose(-3, -2).flatten(-2) @ m.W_o.T
    torch.testing.assert_close(sa.compile(m)(x), ref, atol=TOL, rtol=0)
    truth = sa.inference.exact(m, x)
    torch.testing.assert_close(truth.output, ref, atol=TOL, rtol=0)
    if len(weights) > 2:  # Pyro's marginal of the second hop is P²
        torch.testing.assert_close(truth.marginals["attn.hop2"], P @ P, atol=TOL, rtol=0)


def test_multihop_bad_input():
    with pytest.raises(ValueError, match=r"weights must be \(w_0, …, w_K\) with K ≥ 1"):
        sa.models.multihop_attention(6, hop_weights=(1.0,))
    W = torch.randn(2, 3)

    def program(q, k):
        a, b = sa.nodes("queries", q), sa.nodes("keys", k)
        phi = sa.edges("attn", a, b, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.Bilinear(W, W))
        return sa.value(phi, sa.values.Hops(W))

    with pytest.raises(ValueError, match=r"edge family 'attn': a Hops value walks along edges.*"
                                         r"'queries' and 'keys'"):
        sa.compile(program)(torch.randn(1, 3, 3), torch.randn(1, 4, 3))
