"""Each layer's attention: the declaration a config names, compiled, read over HF's padding.

``declare(config)`` builds the declaration; ``StructAttnAttention`` reads hidden states
``(B, T, hidden)`` whose rows hold their real tokens at the front (``lengths`` each): the model
moves each row's real tokens there once per call (``compact``, from HF's ``attention_mask``
``(B, past + T)``, 1: a token, 0: padding, left or right) and back at the end (``restore``),
so each row is read as if alone, through the layer's decoding cache or, without HF's cache,
a fresh one read with ``lengths=``.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from ... import compile as compile_model
from ...decoding.rules import rule_for
from ...models import REGISTRY
from .configuration import CAUSAL_CATALOGUE


def factory_of(name: str):
    """The factory a config's ``attention`` names: a catalogue model, or ``module:function``."""
    if name in CAUSAL_CATALOGUE:
        return REGISTRY[name]
    module, _, attr = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"StructAttnConfig: attention={name!r} names no importable factory "
                         f"('package.module:function'): {err}") from err
    if not callable(factory):
        raise ValueError(f"StructAttnConfig: attention={name!r} is not callable")
    return factory


def declare(config):
    """The declaration of one layer's attention, as the config states it."""
    factory = factory_of(config.attention)
    kwargs = dict(heads=config.num_attention_heads, d_k=config.head_dim, **config.attention_kwargs)
    declaration = factory(config.hidden_size, **kwargs) if "causal" in kwargs \
        else _with_causal(factory, config.hidden_size, kwargs)
    if not getattr(declaration, "causal", True):
        raise ValueError(f"StructAttnConfig: attention={config.attention!r} built a model that "
                         f"is not causal; a language model's attention must be")
    return declaration


def _with_causal(factory, d_model, kwargs):
    """``factory(d_model, **kwargs)``, built again with ``causal=True`` where that made a
    model that is not causal and the factory takes ``causal``."""
    model = factory(d_model, **kwargs)
    if getattr(model, "causal", True):
        return model
    try:
        return factory(d_model, causal=True, **kwargs)
    except TypeError:
        return model  # refused by ``declare``: not causal, and no causal form


def compact(x: torch.Tensor, mask: torch.Tensor):
    """Each row's real tokens moved, in order, to the front: ``(x', lengths, order)`` with
    ``x'[b, s] = x[b, order[b, s]]`` and ``lengths[b]`` real tokens in row b."""
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # (B, T)
    index = order[..., None].expand_as(x)
    return x.gather(1, index), mask.sum(1), order


def restore(y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``compact``'s inverse on the outputs: ``y`` ``(B, T, d)`` back in the call's order."""
    return torch.zeros_like(y).scatter(1, order[..., None].expand_as(y), y)


class StructAttnAttention(nn.Module):
    """One layer's attention: the compiled declaration (``self.layer``; its parameters are
    the declaration's: ``layer.declaration.W_q`` …) read over HF's padding and cache."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer = compile_model(declare(config))
        self.decodes = _reads_incrementally(self.layer.declaration)

    @property
    def declaration(self):
        return self.layer.declaration

    def forward(self, hidden_states, lengths=None, cache=None, input_norm=None):
        """``(B, T, hidden)`` → ``(B, T, hidden)``; ``lengths`` ``(B,)``: each row's real
        tokens, at its front (``compact``), or None (every token real); ``cache``: this
        layer's ``StructAttnCacheLayer`` or None; ``input_norm``: a ceiling on
        ‖hidden_states‖ for certified eviction."""
        if cache is not None:
            return cache.read(self.layer, hidden_states, lengths, input_norm)
        if lengths is None:
            return self.layer(hidden_states)
        return self.layer(hidden_states, cache=self.layer.new_cache(), lengths=lengths)


def _reads_incrementally(declaration) -> bool:
    """Whether structattn's decoding cache has an incremental reading of the declaration
    (every causal catalogue model; a user's own declaration is read whole at each call)."""
    try:
        rule_for(declaration)
    except (NotImplementedError, ValueError):
        return False
    return True


def new_columns(attention_mask, k: int) -> torch.Tensor:
    """The new tokens' columns of HF's 2-D mask, as booleans ``(B, k)``."""
    if attention_mask.dim() != 2:
        raise ValueError(f"StructAttnForCausalLM: attention_mask must be HF's 2-D padding mask "
                         f"(batch, past + new tokens) of 0s and 1s; got shape "
                         f"{tuple(attention_mask.shape)} (a 4-D mask states a structure: "
                         f"state it as the declaration's support instead)")
    if attention_mask.shape[1] < k:
        raise ValueError(f"StructAttnForCausalLM: attention_mask has {attention_mask.shape[1]} "
                         f"columns, fewer than the call's {k} new tokens")
    return attention_mask[:, -k:].bool()
