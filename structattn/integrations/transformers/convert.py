"""``convert``: a stock Llama-family model turned into a ``StructAttnForCausalLM``.

Every weight is copied: embeddings, norms, MLPs and the LM head as they are; each layer's
q/k/v/o projections into the declaration's W_Q, W_K, W_V, W_O (a grouped-query model's key and
value heads repeated per query head). RoPE is kept as the potential (``rope_base`` from the
stock config's ``rope_theta``); the prior is the one the named attention declares. With the
uniform causal prior (``"self_attention"``) the converted model computes the stock function.
FoX's gate starts at W_f = 0 and b_f = ``gate_bias`` (default 8: f = σ(8) ≈ 0.9997 per token),
so fine-tuning starts next to the pretrained function.
"""

from __future__ import annotations

import torch

from .configuration import CAUSAL_CATALOGUE, StructAttnConfig
from .modeling import StructAttnForCausalLM

#: the stock architectures convert() reads: Llama's layout (q/k/v/o without biases, a SwiGLU
#: MLP, RMSNorms), default RoPE
ARCHITECTURES = ("llama", "mistral")

#: FoX's gate bias when converting: σ(8) ≈ 0.9997, the gates start (almost) open
CONVERTED_GATE_BIAS = 8.0


def convert(model, attention="self_attention", **attention_kwargs) -> StructAttnForCausalLM:
    """A ``StructAttnForCausalLM`` computing ``model``'s function with the attention named.

    Args:
        model: a stock ``LlamaForCausalLM`` or ``MistralForCausalLM`` (no attention or MLP
            biases, default RoPE, no sliding window).
        attention (str | Callable): a causal catalogue model's name (``"self_attention"``,
            ``"alibi_attention"``, ``"forgetting_attention"``, …) or a factory
            ``f(d_model, heads=, d_k=, **kwargs)`` importable by its module and name.
        **attention_kwargs: the declaration's further options (JSON-serialisable), e.g.
            ``gate_bias=`` for FoX; ``rope_base`` defaults to the stock model's.

    Returns:
        StructAttnForCausalLM: in the stock model's dtype and on its device, in its mode
            (train/eval); ``save_pretrained`` writes a config naming the attention.
    """
    stock = model.config
    _check_convertible(model)
    name = attention if isinstance(attention, str) else _import_path(attention)
    kwargs = {"rope_base": float(stock.rope_parameters["rope_theta"]), **attention_kwargs}
    if name == "forgetting_attention":
        kwargs.setdefault("gate_bias", CONVERTED_GATE_BIAS)
    config = StructAttnConfig(
        vocab_size=stock.vocab_size, hidden_size=stock.hidden_size,
        intermediate_size=stock.intermediate_size, num_hidden_layers=stock.num_hidden_layers,
        num_attention_heads=stock.num_attention_heads, head_dim=_head_dim(stock),
        hidden_act=stock.hidden_act, max_position_embeddings=stock.max_position_embeddings,
        initializer_range=stock.initializer_range, rms_norm_eps=stock.rms_norm_eps,
        pad_token_id=stock.pad_token_id, bos_token_id=stock.bos_token_id,
        eos_token_id=stock.eos_token_id, tie_word_embeddings=stock.tie_word_embeddings,
        mlp_bias=getattr(stock, "mlp_bias", False), attention=name, attention_kwargs=kwargs)
    weight = model.lm_head.weight
    converted = StructAttnForCausalLM(config).to(dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        _copy(model, converted, stock)
    return converted.train(model.training)


def _head_dim(stock) -> int:
    return getattr(stock, "head_dim", None) or stock.hidden_size // stock.num_attention_heads


def _check_convertible(model) -> None:
    """Refuse, in one line, a model whose function a structattn layer would not reproduce."""
    stock = model.config
    kind = getattr(stock, "model_type", type(stock).__name__)
    if kind not in ARCHITECTURES:
        raise ValueError(f"convert: model must be one of {ARCHITECTURES} (Llama's layout); "
                         f"got model_type={kind!r}")
    rope = stock.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"convert: only default RoPE converts (structattn's Rotary potential); "
                         f"got rope_type={rope.get('rope_type')!r}")
    window = getattr(stock, "sliding_window", None)
    if getattr(stock, "attention_bias", False) or window is not None \
            and window < stock.max_position_embeddings:
        raise ValueError(f"convert: attention biases and sliding windows are not converted; got "
                         f"attention_bias={getattr(stock, 'attention_bias', False)}, "
                         f"sliding_window={window} (None reads the whole past)")


def _import_path(factory) -> str:
    path = f"{factory.__module__}:{factory.__qualname__}"
    if "<" in path:
        raise ValueError(f"convert: attention must be a catalogue name {CAUSAL_CATALOGUE} or a "
                         f"factory importable by its module and name; got {path}")
    return path


def _copy(stock_model, converted, stock) -> None:
    """Every weight, the attention's projections into the declaration's."""
    source, target = stock_model.model, converted.model
    target.embed_tokens.weight.copy_(source.embed_tokens.weight)
    target.norm.weight.copy_(source.norm.weight)
    if not stock.tie_word_embeddings:
        converted.lm_head.weight.copy_(stock_model.lm_head.weight)
    repeat = stock.num_attention_heads // stock.num_key_value_heads
    d = _head_dim(stock)
    for old, new in zip(source.layers, target.layers, strict=True):
        new.input_layernorm.weight.copy_(old.input_layernorm.weight)
        new.post_attention_layernorm.weight.copy_(old.post_attention_layernorm.weight)
        new.mlp.load_state_dict(old.mlp.state_dict())
        attn, declaration = old.self_attn, new.self_attn.declaration
        declaration.W_q.copy_(attn.q_proj.weight)
        declaration.W_k.copy_(_per_query_head(attn.k_proj.weight, d, repeat))
        declaration.W_v.copy_(_per_query_head(attn.v_proj.weight, d, repeat))
        declaration.W_o.copy_(attn.o_proj.weight)
        if declaration._parameters.get("W_f") is not None:
            declaration.W_f.zero_()


def _per_query_head(weight: torch.Tensor, d: int, repeat: int) -> torch.Tensor:
    """A grouped projection ``(kv_heads·d, in)`` with each head's rows repeated ``repeat``
    times, in order: ``(kv_heads·repeat·d, in)`` (query head h reads key head h // repeat)."""
    rows = weight.reshape(-1, 1, d, weight.shape[-1]).expand(-1, repeat, -1, -1)
    return rows.reshape(-1, weight.shape[-1])
