"""Tiny random models for the transformers integration's tests (no hub access)."""

import pytest

transformers = pytest.importorskip(
    "transformers", reason="the transformers extra is not installed "
    "(pip install 'structattn[transformers]')")

import torch  # noqa: E402
from huggingface_hub.errors import StrictDataclassClassValidationError  # noqa: E402

from structattn.integrations.transformers import (  # noqa: E402
    StructAttnCache,
    StructAttnConfig,
    StructAttnForCausalLM,
    StructAttnPrior,
    aligned_attention,
    convert,
    register_attention,
    use_prior,
)

#: what the test modules import from here, after the skip (never from transformers directly)
__all__ = ["StrictDataclassClassValidationError", "StructAttnCache", "StructAttnConfig",
           "StructAttnForCausalLM", "StructAttnPrior", "aligned_attention", "convert",
           "register_attention", "transformers", "use_prior"]

VOCAB = 40

#: every causal catalogue attention, with a small configuration that reads exactly
CAUSAL = {
    "self_attention": {"rope_base": 100.0},
    "rope_attention": {},
    "alibi_attention": {},
    "forgetting_attention": {},
    "generalised_gaussian_attention": {},
    "stick_breaking_attention": {},
    "expanding_attention": {"inference": None},
    "relative_position_attention": {},
    "absolute_position_attention": {"max_len": 64},
    "multihop_attention": {},
}


def tiny(attention="self_attention", kwargs=None, layers=2, **config):
    """A float64 StructAttnForCausalLM of width 16 (4 heads of 4), in eval mode; the weights'
    scale (initializer_range 0.3) keeps greedy decoding away from ties."""
    cfg = StructAttnConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=layers, num_attention_heads=4, attention=attention,
                           attention_kwargs=dict(CAUSAL.get(attention, {}) if kwargs is None
                                                 else kwargs),
                           initializer_range=0.3, **config)
    return StructAttnForCausalLM(cfg).to(torch.float64).eval()


def greedy_loop(model, ids, new, attention_mask=None):
    """Greedy decoding by full recompute (no cache): each step reads the whole sequence, its
    logits rounded to float32 as generate() rounds them."""
    mask = attention_mask
    for _ in range(new):
        logits = model(ids, attention_mask=mask, use_cache=False).logits[:, -1]
        ids = torch.cat([ids, logits.float().argmax(-1, keepdim=True)], 1)
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
    return ids


class PowerLaw(__import__("structattn").priors.DistancePrior):
    """A user's prior: log w(d) = −a_h·log(1 + d) on j ≤ i, ``a`` learned per head."""

    def __init__(self, a):
        self.a = a
        super().__init__("power-law prior", causal=True)

    def log_at_distance(self, d, dtype=None):
        a = self.a.to(dtype or self.a.dtype).reshape(-1, *([1] * d.dim()))
        return -a * torch.log1p(d.abs().to(a.dtype))


class PowerLawAttention(__import__("structattn").models.SelfAttention):
    """Causal self-attention under the user's power-law prior (a = 1 per head at the start)."""

    def __init__(self, d_model, **kwargs):
        super().__init__(d_model, causal=True, **kwargs)
        self.a = torch.nn.Parameter(torch.ones(self.heads))

    def model(self, x):
        tokens = self.tokens(x)
        return self.attend(self.family_name, tokens, tokens, PowerLaw(self.a))


def power_law_attention(d_model, **kwargs):
    """A user's factory, named in a config as ``tests.integrations.hf:power_law_attention``."""
    return PowerLawAttention(d_model, **kwargs)
