"""Classification: the posterior is a softmax, its NLL the cross-entropy."""

import pytest
import torch
import torch.nn.functional as F

import structattn as sa

TOL = 1e-6


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


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


def test_classification_temperature_string():
    with pytest.raises(ValueError, match=r"Classification: temperature must be a finite number > 0 "
                                         r"or a tensor; got 'learn'"):
        sa.models.classification(6, 3, temperature="learn")
