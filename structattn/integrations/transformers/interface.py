"""Any model that calls transformers' ``AttentionInterface`` under a structattn prior.

``register_attention(name, prior)`` registers ``name`` as an ``attn_implementation``: a
function of the model's own projected q, k, v (RoPE and the cache's past included) that reads
them under a stationary prior, the last query aligned with the last key
(``aligned.aligned_attention``), so prefill and every decoding step read the same
distances. The name is registered with the mask interface as ``sdpa``'s, so that padding
reaches the function as a boolean mask, which it intersects with the prior's support.

The prior of a call: the ``StructAttnPrior`` the attention module carries (``use_prior``
attaches one per module; a learned prior's parameters are then the module's, trained and
saved with the model), else the one the name was registered with.

Registered at import: ``"structattn"`` (each module carries its prior) and
``"structattn_alibi"`` (ALiBi with the paper's slopes for the model's heads).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ...priors.alibi import ALiBi, alibi_slopes
from ...priors.base import Prior
from .aligned import aligned_attention

#: the names this module registered → the prior each was registered with (None: every
#: module carries its own)
REGISTERED: dict[str, object] = {}

#: keyword arguments a model may pass that the function does not read: refused when set
UNREAD = ("sliding_window", "softcap", "position_bias", "s_aux")


class StructAttnPrior(nn.Module):
    """The prior one attention module carries: fixed, or built every call from learned
    parameters, which are this module's (and so the model's) parameters.

    Args:
        prior: a ``structattn.priors.Prior``, or a callable taking the ``parameters`` by name
            and returning one (e.g. ``lambda loc, log_scale, log_shape:
            GeneralisedGaussian(loc, log_scale, log_shape.exp())``).
        **parameters: tensors, registered as ``nn.Parameter`` (a callable ``prior`` only).

    Calling the module returns the prior.
    """

    def __init__(self, prior, **parameters):
        super().__init__()
        if isinstance(prior, Prior):
            if parameters:
                raise ValueError(f"StructAttnPrior: a fixed prior ({prior.describe()}) takes no "
                                 f"parameters; got {sorted(parameters)} (give a callable that "
                                 f"builds the prior from them)")
            self.fixed, self.build = prior, None
        elif callable(prior):
            self.fixed, self.build = None, prior
        else:
            raise ValueError(f"StructAttnPrior: prior must be a structattn.priors.Prior or a "
                             f"callable returning one; got {type(prior).__name__}")
        for name, value in parameters.items():
            self.register_parameter(name, value if isinstance(value, nn.Parameter)
                                    else nn.Parameter(torch.as_tensor(value)))

    def forward(self) -> Prior:
        if self.fixed is not None:
            return self.fixed
        built = self.build(**dict(self.named_parameters(recurse=False)))
        if not isinstance(built, Prior):
            raise ValueError(f"StructAttnPrior: the callable returned {type(built).__name__}, "
                             f"not a structattn.priors.Prior")
        return built


def register_attention(name: str = "structattn", prior=None) -> str:
    """Register ``name`` as an ``attn_implementation`` (and its mask); returns ``name``.

    Args:
        name: the implementation's name, not one of transformers' own.
        prior: the prior of a module that carries none: None (each module must carry a
            ``StructAttnPrior``), a ``Prior`` shared by every layer, or a callable taking
            the number of query heads and returning one.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_attention: name must be a non-empty string; got {name!r}")
    if name not in REGISTERED and (name == "eager" or name in AttentionInterface._global_mapping):
        raise ValueError(f"register_attention: name={name!r} is transformers' own "
                         f"attn_implementation; choose another")
    if prior is not None and not isinstance(prior, Prior) and not callable(prior):
        raise ValueError(f"register_attention: prior must be None, a structattn.priors.Prior "
                         f"or a callable heads -> Prior; got {type(prior).__name__}")
    REGISTERED[name] = prior
    AttentionInterface.register(name, _attention(name))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's attention modules: those whose class name ends in ``Attention`` and that
    hold a ``layer_idx`` (transformers' convention)."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


def use_prior(model: nn.Module, prior, name: str = "structattn", modules=None) -> nn.Module:
    """Attach a ``StructAttnPrior`` to each attention module and switch ``model`` to ``name``.

    Args:
        model: a transformers ``PreTrainedModel`` whose attention calls ``AttentionInterface``.
        prior: a ``Prior`` or a ``StructAttnPrior`` (shared by every module), or a callable
            taking the module and returning either (one per module: e.g. learned priors).
        name: the ``attn_implementation``, registered here if it is not yet.
        modules: the attention modules; None: ``attention_modules(model)``.

    Returns the model.
    """
    targets = attention_modules(model) if modules is None else list(modules)
    if not targets:
        raise ValueError(f"use_prior: found no attention module in {type(model).__name__} "
                         f"(a module named *Attention with a layer_idx); pass modules=")
    shared = StructAttnPrior(prior) if isinstance(prior, Prior) else prior
    for module in targets:
        made = shared if isinstance(shared, StructAttnPrior) else _call(shared, module)
        module.add_module("structattn_prior", made)
    if name not in REGISTERED:
        register_attention(name)
    model.set_attn_implementation(name)
    return model


def _call(factory, module) -> StructAttnPrior:
    if not callable(factory):
        raise ValueError(f"use_prior: prior must be a Prior, a StructAttnPrior or a callable "
                         f"module -> either; got {type(factory).__name__}")
    made = factory(module)
    if isinstance(made, Prior):
        return StructAttnPrior(made)
    if not isinstance(made, StructAttnPrior):
        raise ValueError(f"use_prior: the prior callable returned {type(made).__name__} for "
                         f"{type(module).__name__}; expected a Prior or a StructAttnPrior")
    return made


def _prior_of(module, name: str, heads: int) -> Prior:
    """The module's own ``StructAttnPrior``'s prior, else the one ``name`` was registered
    with."""
    for child in module.children() if isinstance(module, nn.Module) else ():
        if isinstance(child, StructAttnPrior):
            return child()
    default = REGISTERED[name]
    if default is None:
        raise ValueError(f"attn_implementation {name!r}: {type(module).__name__} carries no "
                         f"StructAttnPrior and {name!r} was registered without a prior; "
                         f"use_prior(model, prior, name={name!r}) attaches one")
    return default if isinstance(default, Prior) else default(heads)


def _attention(name: str) -> Callable:
    """The function registered for ``name``, called as transformers' attention modules call
    ``AttentionInterface``'s functions."""
    def structattn_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, is_causal=None, **kwargs):
        owner = f"attn_implementation {name!r}"
        if dropout:
            raise ValueError(f"{owner}: dropout={dropout} on the attention weights is not "
                             f"read; set the model's attention dropout to 0")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if not causal:
            raise ValueError(f"{owner}: is_causal=False; the interface reads causal "
                             f"self-attention (the queries are the last keys)")
        unread = sorted(k for k in UNREAD if kwargs.get(k) is not None)
        if unread:
            raise ValueError(f"{owner}: {unread} are not read; the prior states the structure")
        C, P = query.shape[-2], key.shape[-2]
        if attention_mask is None and 1 < C < P:
            raise ValueError(f"{owner}: {C} queries over {P} keys with no attention_mask, "
                             f"which transformers passes for queries in the first {C} slots "
                             f"(an empty StaticCache's prefill); the queries are aligned with "
                             f"the last keys: use a DynamicCache")
        prior = _prior_of(module, name, query.shape[1])
        out = aligned_attention(query, key, value, prior, attention_mask, scaling, owner=owner)
        return out.transpose(1, 2).contiguous(), None
    return structattn_attention


def _alibi(heads: int) -> ALiBi:
    """Causal ALiBi with the paper's slopes, in float64 (the table is cast to the queries'
    dtype)."""
    return ALiBi(heads, slopes=alibi_slopes(heads).double(), causal=True)


register_attention("structattn")
register_attention("structattn_alibi", _alibi)
