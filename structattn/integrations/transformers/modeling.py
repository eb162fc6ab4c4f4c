"""``StructAttnModel`` / ``StructAttnForCausalLM``: Llama's decoder with structattn attention.

h ← h + attn(RMSNorm(h)); h ← h + MLP(RMSNorm(h)) per layer, with Llama's own RMSNorm and
SwiGLU MLP (``transformers.models.llama``), so a converted Llama keeps every weight it had.
Positions are each row's count of real tokens (what HF derives from a padding mask): the
declaration states them (RoPE as its potential, ALiBi as its prior…), not ``position_ids``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from ...models._projections import ProjectedAttention
from .attention import StructAttnAttention, compact, new_columns, restore
from .cache import StructAttnCache, rms_norm_ceiling
from .configuration import StructAttnConfig


class StructAttnDecoderLayer(GradientCheckpointingLayer):
    """One Llama layer whose ``self_attn`` is the compiled structattn declaration."""

    def __init__(self, config: StructAttnConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = StructAttnAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, lengths=None, cache=None):
        """``lengths``: each row's real tokens, at its front, or None (all real); ``cache``:
        the model's ``StructAttnCache`` or None."""
        layer_cache = None if cache is None else cache.layer(self.layer_idx)
        ceiling = None if layer_cache is None or layer_cache.decode is not None \
            else rms_norm_ceiling(self.input_layernorm)
        h = self.self_attn(self.input_layernorm(hidden_states), lengths, layer_cache, ceiling)
        hidden_states = hidden_states + h
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class StructAttnPreTrainedModel(PreTrainedModel):
    config_class = StructAttnConfig
    config: StructAttnConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["StructAttnDecoderLayer"]

    def _init_weights(self, module):
        """Llama's initialisation (normal(0, initializer_range) for the linear maps, ones for
        the norms), and the same normal for the declaration's projections W_Q, W_K, W_V, W_O
        (and FoX's gate weights W_f); the prior's own parameters keep the values it declares."""
        super()._init_weights(module)
        if isinstance(module, ProjectedAttention):
            std = self.config.initializer_range
            for name in ("W_q", "W_k", "W_v", "W_o", "W_f"):
                weight = module._parameters.get(name)
                if weight is not None:
                    nn.init.normal_(weight, mean=0.0, std=std)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own StructAttnCache (HF's DynamicCache holds K, V)


class StructAttnModel(StructAttnPreTrainedModel):
    """Embeddings, the layers and the final RMSNorm: ``last_hidden_state (B, T, hidden)``."""

    def __init__(self, config: StructAttnConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(StructAttnDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    @property
    def decodes(self) -> bool:
        """Whether every layer's attention has an incremental reading (a ``StructAttnCache``):
        every causal catalogue model; a user's own declaration is read whole at each call,
        so ``generate()`` runs without a cache."""
        return all(layer.self_attn.decodes for layer in self.layers)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, use_cache=None, output_hidden_states=None, **kwargs):
        """``use_cache``: None reads ``config.use_cache`` in eval mode and False in training;
        with a cache, the call's tokens are read after those it holds. ``position_ids`` are
        refused unless they are each row's count of real tokens (see the module)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("StructAttnModel: give exactly one of input_ids and inputs_embeds")
        _refuse_unread(kwargs)
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training and self.decodes
        if use_cache and cache is None:
            cache = StructAttnCache(self.config)
        if cache is not None and not isinstance(cache, StructAttnCache):
            raise TypeError(f"StructAttnModel: cache must be a StructAttnCache (structattn's "
                            f"decoding caches per layer); got {type(cache).__name__}")
        if position_ids is not None:
            _check_positions(position_ids, attention_mask, cache, h.shape[1])
        # padding: each row's real tokens moved to its front once, read with their count by
        # every layer (the norms and MLPs read tokens one by one), put back at the end
        mask = None if attention_mask is None else new_columns(attention_mask, h.shape[1])
        lengths = order = None
        if mask is not None and not bool(mask.all()):
            h, lengths, order = compact(h, mask)
        states = [h] if output_hidden_states else None
        for layer in self.layers:
            h = layer(h, lengths, cache)
            if states is not None:
                states.append(h)
        h = self.norm(h)
        if states is not None:
            states[-1] = h
            states = [s if order is None else restore(s, order) for s in states]
        if order is not None:
            h = restore(h, order)
        return BaseModelOutputWithPast(last_hidden_state=h, cache=cache if use_cache else None,
                                       hidden_states=None if states is None else tuple(states))


class StructAttnForCausalLM(StructAttnPreTrainedModel, GenerationMixin):
    """The model and its LM head: logits ``(B, T, vocab)``, the loss with ``labels``."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: StructAttnConfig):
        super().__init__(config)
        self.model = StructAttnModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        if not self.model.decodes:
            self.generation_config.use_cache = False  # generate() reads the whole sequence

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0,
                output_hidden_states=None, return_dict=None, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, cache=cache, inputs_embeds=inputs_embeds,
                         use_cache=use_cache, output_hidden_states=output_hidden_states, **kwargs)
        h = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            h = h[:, -logits_to_keep:] if logits_to_keep else h
        else:
            h = h[:, logits_to_keep]
        logits = self.lm_head(h)
        loss = None if labels is None else self.loss_function(
            logits=logits, labels=labels, vocab_size=self.config.vocab_size,
            **{k: v for k, v in kwargs.items() if k == "num_items_in_batch"})
        result = CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache,
                                        hidden_states=out.hidden_states)
        return result if return_dict is not False else result.to_tuple()


#: keyword arguments HF passes that this model has nothing to do with
_IGNORED = {"num_items_in_batch", "return_dict", "output_attentions"}


def _refuse_unread(kwargs) -> None:
    """Refuse, in one line, a keyword argument the model would otherwise drop silently."""
    if kwargs.get("output_attentions"):
        raise ValueError("StructAttnModel: output_attentions is not served; a compiled layer "
                         "returns its posterior p(φ_i = j | x) with return_posterior=True")
    unknown = sorted(set(kwargs) - _IGNORED)
    if unknown:
        raise TypeError(f"StructAttnModel.forward got arguments it does not read: {unknown}")


def _check_positions(position_ids, attention_mask, cache, k: int) -> None:
    """``position_ids`` must be what the model reads anyway: each row's count of real tokens
    before a token (the cache's held columns count only where real)."""
    past = 0 if cache is None else cache.get_seq_length()
    mask = (torch.ones(position_ids.shape[0], past + k, dtype=torch.long,
                       device=position_ids.device) if attention_mask is None
            else attention_mask.to(device=position_ids.device, dtype=torch.long))
    expected = (mask.cumsum(-1) - 1)[:, -k:]
    real = mask[:, -k:].bool()
    if not torch.equal(position_ids.expand_as(expected)[real], expected[real]):
        raise ValueError("StructAttnModel: position_ids must count each row's real tokens "
                         "(attention_mask.cumsum(-1) - 1): the declaration states positions "
                         "from them; other positions (packed sequences) are not read")
