"""``StructAttnCache``: HF's ``Cache`` holding one structattn decoding cache per layer.

``generate()`` and a caller continuing from a returned cache see HF's interface (the columns
read so far: ``get_seq_length()``); each layer's attention reads its new tokens through its
own ``DecodeCache`` (``layer.new_cache(...)``): growing, a fixed ``capacity`` (StaticCache's
role) or certified eviction (``tol=``). With ``tol`` and no ceilings given, each layer's
ceiling on ‖x‖ is derived from the RMSNorm before it: ‖w ⊙ x/rms(x)‖ ≤ max|w|·√d.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class StructAttnCacheLayer(CacheLayerMixin):
    """One layer: its structattn ``DecodeCache`` (``decode``, made at the layer's first call)
    and the columns of HF's sequence it has read (``columns``, padding included)."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, options: dict):
        super().__init__()
        self.options = options
        self.decode = None
        self.columns = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError("StructAttnCache holds structattn's decoding caches, which read hidden "
                        "states: it serves StructAttnForCausalLM, not an attention that hands it "
                        "keys and values (use DynamicCache there)")

    def get_seq_length(self) -> int:
        return self.columns

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    def get_max_length(self) -> int:
        return self.options.get("capacity") or -1

    def reset(self) -> None:
        self.decode, self.columns = None, 0

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("StructAttnCache: beam search reorders the cache's rows, "
                                  "which structattn's caches do not do; generate greedily or "
                                  "by sampling (num_beams=1)")

    def read(self, layer, x, lengths=None, input_norm=None):
        """The layer's outputs for ``x`` ``(B, k, d)`` read after what this layer holds."""
        if self.decode is None:
            options = dict(self.options)
            if options.get("tol") is not None and not {"input_norm", "query_norm",
                                                        "key_norm"} & options.keys():
                options["input_norm"] = input_norm
            self.decode = layer.new_cache(**options)
        y = layer(x, cache=self.decode) if lengths is None \
            else layer(x, cache=self.decode, lengths=lengths)
        self.columns += x.shape[1]
        return y


class StructAttnCache(Cache):
    """One structattn decoding cache per layer of a ``StructAttnForCausalLM``.

    Args:
        config: the model's ``StructAttnConfig`` (its ``num_hidden_layers``).
        capacity (int | None): room for this many tokens per row in every layer (fixed
            shapes: each step replays one plan); None (default): caches that grow.
        tol (float | None): certified eviction: each layer drops its oldest tokens once their
            posterior mass is proved ≤ tol for every later query (the prior must be one that
            allows it: ALiBi, FoX, the generalised Gaussian with loc ≤ 0).
        **ceilings: ``input_norm``, ``query_norm``, ``key_norm``, ``block`` for ``tol``
            (``DecodeCache``); without ceilings, ``input_norm`` comes from each layer's RMSNorm.
    """

    def __init__(self, config, *, capacity: int | None = None, tol: float | None = None,
                 **ceilings):
        options = {key: value for key, value in
                   dict(capacity=capacity, tol=tol, **ceilings).items() if value is not None}
        super().__init__(layers=[StructAttnCacheLayer(options)
                                 for _ in range(config.num_hidden_layers)])

    def layer(self, layer_idx: int) -> StructAttnCacheLayer:
        return self.layers[layer_idx]

    def decode_caches(self) -> list:
        """Each layer's structattn ``DecodeCache`` (None before its first call)."""
        return [layer.decode for layer in self.layers]

    @property
    def evicted(self) -> list[int]:
        """How many of each row's first tokens each layer has evicted (0 without ``tol``)."""
        return [0 if c is None else c.evicted for c in self.decode_caches()]

    @property
    def bound(self) -> float:
        """The largest bound, over layers, on the posterior mass the evicted tokens hold at the
        last call's queries (0.0 while nothing is evicted); ≤ tol while ``certified``."""
        steps = [c.trace[-1] for c in self.decode_caches() if c is not None and c.trace]
        return max((step.bound for step in steps), default=0.0)

    @property
    def certified(self) -> bool:
        """Whether every layer's bound is proved (False once a token broke its ceilings)."""
        return all(c.trace[-1].certified for c in self.decode_caches()
                   if c is not None and c.trace)

    def held(self) -> list[int]:
        """How many tokens each layer holds per row (the longest row's)."""
        return [0 if c is None else len(c) for c in self.decode_caches()]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if any(c is not None for c in self.decode_caches()):
            raise NotImplementedError("StructAttnCache: repeating a filled cache's rows is not "
                                      "supported; pass the repeated prompts instead")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("StructAttnCache: selecting rows of a filled cache is not "
                                  "supported")

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("StructAttnCache: a structattn cache cannot drop its last "
                                  "tokens (assisted decoding needs that); generate without it")


def rms_norm_ceiling(norm: torch.nn.Module) -> float:
    """A ceiling on ‖RMSNorm(x)‖ over every x: max|w|·√d (‖x/rms(x)‖ ≤ √d)."""
    weight = norm.weight.detach()
    return float(weight.abs().max()) * math.sqrt(weight.numel())
