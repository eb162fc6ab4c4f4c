"""The catalogue under test: name → a small (model, inputs) case, float64.

Every entry of ``structattn.models.REGISTRY`` must appear here (test_catalogue
checks it), so the generic tests cover every model.
"""

import torch

import structattn as sa


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def self_attention_case():
    m = sa.models.self_attention(7, d_k=3, d_v=5, heads=2, causal=True, dtype=torch.float64)
    return m, (_x(2, 5, 7),)


def cross_attention_case():
    m = sa.models.cross_attention(7, 11, d_k=3, d_v=2, heads=3, dtype=torch.float64)
    return m, (_x(2, 5, 7), _x(2, 3, 11))


CASES = {
    "self_attention": self_attention_case,
    "cross_attention": cross_attention_case,
}
