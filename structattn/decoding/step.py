"""A step against a ``FixedCache``: the new tokens read over the cache's whole capacity, the
slots beyond each row's tokens masked out, so that its tensors' shapes do not depend on the
lengths — one recorded plan serves every step, and ``torch.compile`` traces it once.

y_i = W_O [Σ_{j < capacity} p(φ_i = j | x) [j < ends_b] W_V x_j]_heads for the new tokens i:
the rows of the full forward's causal problem (``read``), with the parents that are not the
row's tokens given no mass.
"""

from __future__ import annotations

import weakref
from types import MappingProxyType

import torch
import torch.nn.functional as F

from ..checking import _validation
from ..compiling.replay import MISSED
from ..heads import merge_heads, split_heads
from ..plans.fast_path import CacheStep
from ..potentials import Bilinear
from .project import project as _project
from .project import rotated
from .rules import Normalised
from .static import FixedCache, scatter_index, write


class Held:
    """What a rule's ``posterior`` reads of the cache: the prior's state (FoX's c) at every
    slot, and at the new tokens ``new_state (B, H, k)``."""

    __slots__ = ("state", "new_state")

    def __init__(self, state, new_state=None):
        self.state, self.new_state = state, new_state


def step(model, rule, x, keys, values, state, lengths, counts=None, *, capacity: int,
         return_posterior: bool = False):
    """The new tokens of ``x (B, k, d)`` read after each row's ``lengths (B,)`` cached tokens.

    ``keys``, ``values``, ``state``: the ``FixedCache``'s storage (capacity + 1 slots; the
    new tokens are written into it, in place without gradients); ``counts (B,)``: each row's
    real new tokens (None: k). Returns ``y (B, k, d_out)``, the storage as written, each
    row's new length ``ends (B,)`` and, asked for, the posterior ``(B, H, k, capacity)``, as
    ``_out``'s flat tuple (``_parts`` names them). Every shape is fixed by x's and the
    storage's: no value is read on the host."""
    B, k, _ = x.shape
    H, L = model.heads, capacity
    _validation.check_finite("x_new", x)
    slot = torch.arange(k, device=x.device)
    pos = lengths[:, None] + slot  # (B, k): the new tokens' positions in their rows
    parents = torch.arange(L, device=x.device)
    if counts is None:  # every new token real: no padding; the causal support is the row's
        counts_given = False
        counts = torch.full((B,), k, dtype=torch.long, device=x.device)
        real = torch.ones(B, k, dtype=torch.bool, device=x.device)
        ends = lengths + k
        at = pos
        valid = None
    else:
        counts_given = True
        real = slot < counts[:, None]  # (B, k)
        ends = lengths + counts  # (B,)
        at = torch.where(real, pos, L)  # (B, k): padding to the spare slot
        valid = (parents[None, None, :] < ends[:, None, None]) & real[:, :, None]  # (B, k, L)
    weights = getattr(model, "hop_weights", (0.0, 1.0))
    hops, d_v = len(weights) - 1, model.d_v

    q, key, value = _project_step(model, x, pos)  # (B, H, k, d_k), (…, d_k), (…, d_v)
    v_new = value if hops == 1 else torch.cat([value, value.new_zeros(
        *value.shape[:-1], d_v * (hops - 1))], -1)
    if key.shape == v_new.shape and not torch.compiler.is_compiling():  # one index for both
        index = scatter_index(at, key)
        keys, values = write(keys, at, key, index), write(values, at, v_new, index)
    else:
        keys, values = write(keys, at, key), write(values, at, v_new)
    if rule.state:  # (token j's state at slot j + 1; slot 0 holds 0: FixedCache.start)
        held = state.gather(-1, lengths.view(B, 1, 1).expand(B, H, 1))[..., 0]  # (B, H):
        # each row's last token's state, 0 for an empty row
        new_state = rule.new_state(model, x, counts if counts_given else None, held)
        state = _write_state(state, at + 1, new_state)  # (B, H, k) at the new tokens

    scale = Bilinear(model.W_q, model.W_k, heads=H, temperature=model.temperature).factor_scale()
    if isinstance(scale, torch.Tensor):
        scale = scale.to(dtype=q.dtype, device=q.device)
    held = Held(None, None) if state is None else Held(state[..., 1:L + 1], new_state)
    if isinstance(rule, Normalised) and counts_given is False and hops == 1 \
            and not return_posterior and not isinstance(scale, torch.Tensor):
        # every row real (each allows itself): one attention kernel, the prior an additive mask
        bias, allowed = rule.bias(model, pos, parents, valid, held, q.dtype)
        mask = allowed if bias is None else torch.where(allowed, bias, float("-inf"))
        expected = F.scaled_dot_product_attention(q, keys[..., :L, :], values[..., :L, :],
                                                  attn_mask=mask, scale=scale)
        y = merge_heads(expected)  # (B, k, H·d_v)
        if model.W_o is not None:
            y = F.linear(y, model.W_o)
        return _out(y, None, keys, values, state, ends)
    scores = (q @ keys[..., :L, :].transpose(-1, -2)) * scale  # (B, H, k, L)
    post = rule.posterior(model, scores, pos, parents, valid, held)  # (B, H, k, L)

    expected = value * weights[0] if weights[0] else None
    for m in range(1, hops + 1):  # hop m + 1 of the new rows: their posterior times hop m
        hop = post @ values[..., :L, (m - 1) * d_v:m * d_v]  # (B, H, k, d_v)
        if m < hops:
            values = _write_block(values, at, hop, slice(m * d_v, (m + 1) * d_v))
        if weights[m]:
            term = hop * weights[m] if weights[m] != 1.0 else hop
            expected = term if expected is None else expected + term
    if expected is None:
        expected = torch.zeros_like(value)
    expected = expected.masked_fill(~real[:, None, :, None], 0.0)
    y = merge_heads(expected)  # (B, k, H·d_v); zero at padding
    if model.W_o is not None:
        y = F.linear(y, model.W_o)
    return _out(y, post if return_posterior else None, keys, values, state, ends)


def _project_step(model, x, pos):
    """``project.project``; where the keys are x's alone (no absolute positions), one
    projection by W_q, W_k and W_v stacked — in a recorded plan without gradients the stack
    is a constant, made once per change of the weights."""
    if getattr(model, "positions", None) is not None or torch.compiler.is_compiling():
        return _project(model, x, pos)
    H, d_q, d_v = model.heads, model.W_q.shape[0], model.W_v.shape[0]
    both = F.linear(x, torch.cat([model.W_q, model.W_k, model.W_v]))  # (B, k, 2·d_q + d_v)
    if d_q == d_v:  # (B, k, 3, H, d) → three (B, H, k, d) views in two calls
        q, key, value = both.unflatten(-1, (3, H, d_q // H)).permute(2, 0, 3, 1, 4).unbind(0)
    else:
        q, key, value = (split_heads(t, H) for t in both.split([d_q, d_q, d_v], -1))
    return (*rotated(model, q, key, pos), value)


def _out(y, post, keys, values, state, ends) -> tuple:
    """The step's tensors, flat, without a None (what a plan returns fastest): ``(y, keys,
    values, ends[, state][, post])``; ``_parts`` reads them back."""
    return (y, keys, values, ends) + ((state,) if state is not None else ()) \
        + ((post,) if post is not None else ())


def _parts(out: tuple, state: bool, posterior: bool) -> tuple:
    """``(y, post, keys, values, state, ends)`` from ``_out``'s tuple."""
    y, keys, values, ends, *rest = out
    s = rest.pop(0) if state else None
    return y, (rest[0] if posterior else None), keys, values, s, ends


def _write_state(state, at, new):
    """``write`` for a state ``(B, H, L)`` of one number per token, ``new (B, H, k)``: the
    same tensor where written in place."""
    if not torch.compiler.is_compiling():  # eagerly one scatter along the tokens: (B, H, L)
        return write(state, at, new)
    out = write(state.unsqueeze(-1), at, new.unsqueeze(-1))
    return out[..., 0] if out.requires_grad else state


def _write_block(values, at, new, block: slice):
    """The features ``block`` of the values just written at ``at`` overwritten with ``new
    (B, H, k, width)``: a multihop value's next hop, known once the new rows' posterior is."""
    rows = torch.arange(at.shape[0], device=at.device)[:, None].expand_as(at)
    held = values.movedim(1, 2)[rows, at]  # (B, k, H, d)
    new = new.movedim(1, 2)
    held = torch.cat([held[..., :block.start], new, held[..., block.stop:]], -1)
    return write(values, at, held.movedim(2, 1))


class StepReading:
    """A layer's steps against a ``FixedCache`` as the plan compiler sees a module: its
    ``declaration`` and ``interpret(x, keys, values, [state], lengths, [counts], …)``, a pure
    tensor function (``step``) that ``structattn.compiling.replay.Plans`` records once per signature and
    replays. Kept by the compiled layer (``steps``)."""

    def __init__(self, layer, rule, capacity):
        from ..compiling.replay import Plans

        self.declaration = layer.declaration
        self._modules = {"declaration": layer.declaration}  # what a fast path checks
        self.rule = rule
        self.plans = Plans(layer._plans.enabled, max_plans=layer._plans.max_plans,
                           dynamic=layer._plans.dynamic)
        self.capacity = capacity

    def cache_step(self, plan, options) -> CacheStep | None:
        """What the plan's ``_Last`` generates the layer's whole decoding call for: a step's
        plan whose new tokens are all real and that returns no posterior (``_STEP``), whose
        output is ``_out``'s flat tuple; None for other steps (read by ``read_fixed``)."""
        state = options is _STEP[1]
        if (options is not _STEP[0] and not state) or plan.literals \
                or plan.spec is None or plan.spec.type is not tuple \
                or plan.n_tensors != 4 + state:
            return None
        return CacheStep(FixedCache, self, self.capacity, state)

    def interpret(self, *tensors, state: bool, counts: bool, return_posterior: bool):
        x, keys, values, *rest = tensors
        st = rest.pop(0) if state else None
        lengths = rest.pop(0)
        c = rest.pop(0) if counts else None
        return step(self.declaration, self.rule, x, keys, values, st, lengths, c,
                    capacity=self.capacity, return_posterior=return_posterior)


#: compiled layer → {capacity: its ``StepReading``}: kept beside the layer, not in it (a copy
#: or a pickle of the layer starts without them, as with its own plans)
_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def steps(layer, rule, capacity: int) -> StepReading:
    """The layer's ``StepReading`` for caches of this capacity (one per capacity; its plans
    are its caches' ``plans``), made anew when the layer's declaration was
    replaced; ``rule``: the declaration's as it reads now."""
    kept = _STEPS.get(layer)
    if kept is None:
        kept = _STEPS[layer] = {}
    reading = kept.get(capacity)
    if reading is None or reading.declaration is not layer.declaration:
        reading = kept[capacity] = StepReading(layer, rule, capacity)
    reading.rule = rule
    return reading


def read_fixed(layer, rule, x, counts, cache: FixedCache, batch_shape, return_posterior):
    """``read`` for a ``FixedCache``: the step recorded as a plan and replayed (eagerly under
    torch.compile, which traces it); ``counts`` None: every new token is real."""
    model = layer.declaration
    owner = type(model).__name__
    k = x.shape[-2]
    weights = getattr(model, "hop_weights", (0.0, 1.0))
    if cache.keys is None:
        cache.start(batch_shape, model.heads, model.d_k, model.d_v * (len(weights) - 1), x,
                    rule.state)
    keys, values, state = cache.stores
    tensors = [x, keys, values] + ([state] if state is not None else []) + [cache._lengths] \
        + ([counts] if counts is not None else [])
    options = _options(state is not None, counts is not None, return_posterior)
    plans = None
    if torch.compiler.is_compiling():  # traced by dynamo: the step itself, no plan
        cache._bound = None  # kept on the host: read by the next eager call
        out = step(model, rule, x, keys, values, state, cache._lengths, counts,
                   capacity=cache.capacity, return_posterior=return_posterior)
        ends = out[3]  # (_out)
        torch._assert_async((ends <= cache.capacity).all(), f"{owner}: the cache would hold "
                             f"more tokens in a row than its capacity={cache.capacity}")
    else:
        cache.make_room(owner, k, counts)
        reading = cache._steps = steps(layer, rule, cache.capacity)
        plans = reading.plans
        out = MISSED
        if plans._last is not None:
            out = plans._last.run(reading, tuple(tensors), options)
            if out is MISSED:
                out = plans.replay_recent(reading, tuple(tensors), options)
        if out is MISSED:
            out = plans(reading, tuple(tensors), options)
    y, post, keys, values, state, ends = _parts(out, state is not None, return_posterior)
    # the next step's call in one function: that of the plan that served this one (if any)
    cache._step = None if plans is None or plans._last is None else plans._last.step
    cache.stores = [keys, values, state]
    cache._lengths = ends
    cache.keys_read = cache.capacity  # a fixed shape: every slot, masked
    y = y.reshape(*batch_shape, k, y.shape[-1])
    if return_posterior:
        return y, post.reshape(*batch_shape, *post.shape[1:])
    return y


#: every step's options, read-only (``(state, counts, return_posterior)`` → its mapping): a
#: plan recorded with one of them knows a later call's options by their identity alone
_OPTIONS = {(s, c, p): MappingProxyType({"state": s, "counts": c, "return_posterior": p})
            for s in (False, True) for c in (False, True) for p in (False, True)}
#: the options of a step with every new token real and no posterior, without and with a state
_STEP = (_OPTIONS[False, False, False], _OPTIONS[True, False, False])


def _options(state: bool, counts: bool, return_posterior: bool) -> MappingProxyType:
    """The step's options as one of ``_OPTIONS``."""
    return _OPTIONS[bool(state), bool(counts), bool(return_posterior)]
