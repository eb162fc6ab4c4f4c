"""Tiny random models for the transformers integration's tests (no hub access)."""

import pytest

transformers = pytest.importorskip(
    "transformers", reason="the transformers extra is not installed "
    "(pip install 'structattn[transformers]')")

import torch  # noqa: E402

from structattn.integrations.transformers import (  # noqa: E402
    StructAttnCache,
    StructAttnConfig,
    StructAttnForCausalLM,
    StructAttnPrior,
    aligned_attention,
    register_attention,
    use_prior,
)

__all__ = ["StructAttnCache", "StructAttnConfig", "StructAttnForCausalLM", "StructAttnPrior",
           "aligned_attention", "register_attention", "transformers", "use_prior"]

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
