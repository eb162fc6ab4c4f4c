"""``StructAttnConfig``: a Llama-shaped decoder whose attention is a structattn declaration.

The layers are Llama's (RMSNorm, a SwiGLU MLP, residuals); each layer's attention is the
declaration ``attention`` names — a causal catalogue model (``"self_attention"``,
``"alibi_attention"``, ``"forgetting_attention"``, …) or a user's factory given as
``"package.module:function"`` — built as ``factory(hidden_size, heads=num_attention_heads,
d_k=head_dim, **attention_kwargs)`` (with ``causal=True`` where the factory takes it).
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

#: the causal catalogue models a config may name (the others are not causal, or read an
#: adjacency given with every call)
CAUSAL_CATALOGUE = ("self_attention", "rope_attention", "alibi_attention", "forgetting_attention",
                    "generalised_gaussian_attention", "stick_breaking_attention",
                    "expanding_attention", "relative_position_attention",
                    "absolute_position_attention", "multihop_attention")


@strict
class StructAttnConfig(PreTrainedConfig):
    r"""A decoder-only language model: embeddings, ``num_hidden_layers`` layers of
    $h ← h + \mathrm{attn}(\mathrm{RMSNorm}(h))$, $h ← h + \mathrm{MLP}(\mathrm{RMSNorm}(h))$,
    a final RMSNorm and the LM head; ``attn`` is the structattn declaration ``attention``
    names, compiled (``structattn.compile``).

    Args beyond Llama's (``vocab_size``, ``hidden_size``, ``intermediate_size``,
    ``num_hidden_layers``, ``num_attention_heads``, ``head_dim``, ``hidden_act``,
    ``rms_norm_eps``, ``initializer_range``, ``tie_word_embeddings``, ``mlp_bias``):

    - ``attention`` (str): a causal catalogue model's name (``CAUSAL_CATALOGUE``) or a
      factory's import path ``"package.module:function"``. Default ``"self_attention"``.
    - ``attention_kwargs`` (dict): the factory's further keyword arguments, JSON-serialisable
      (e.g. ``{"rope_base": 10000.0}``, ``{"gate_bias": 3.0}``).
    """

    model_type = "structattn"

    vocab_size: int = 256
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False
    mlp_bias: bool = False
    attention: str = "self_attention"
    attention_kwargs: dict | None = None

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.attention_kwargs is None:
            self.attention_kwargs = {}
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Refuses, in one line, an attention that is neither a causal catalogue model nor an
        import path, and sizes that do not fit."""
        if not isinstance(self.attention, str) or not (
                self.attention in CAUSAL_CATALOGUE or ":" in self.attention):
            raise ValueError(f"StructAttnConfig: attention must be a causal catalogue model "
                             f"{CAUSAL_CATALOGUE} or a factory's import path "
                             f"'package.module:function'; got {self.attention!r}")
        if self.hidden_size % self.num_attention_heads and self.head_dim is None:
            raise ValueError(f"StructAttnConfig: hidden_size={self.hidden_size} is not a multiple "
                             f"of num_attention_heads={self.num_attention_heads}; give head_dim")
