"""``read``: a causal layer's new tokens read after everything its cache holds.

y_i = W_O [Σ_j p(φ_i = j | x) W_V x_j]_heads for the new tokens i, over the cached and new
parents j: the rows of the full forward's square problem that belong to the new tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checking._validation import checks_on, passes, shape_str
from ..heads import merge_heads
from ..potentials import Bilinear
from .cache import DecodeCache
from .evict import eviction
from .project import project as _project
from .rules import Normalised, Stick, rule_for
from .static import FixedCache
from .step import read_fixed
from .stick import read_backwards


def new_cache(layer, capacity: int | None = None, tol=None, **ceilings) -> DecodeCache:
    """An empty cache for ``layer`` (refused, naming ``cache=``, for a model that is not
    causal): one that grows as it fills (``capacity=None``), or a ``FixedCache`` with room for
    ``capacity`` tokens per row, whose steps replay one recorded plan. With ``tol``, a growing
    cache that evicts its oldest key blocks once their posterior mass is proved ≤ tol for
    every later query (``structattn.decoding.evict.eviction`` takes the ``ceilings``:
    ``query_norm`` and ``key_norm``, or ``input_norm``, and ``block``)."""
    model = layer.declaration
    rule_for(model)
    owner = type(model).__name__
    if tol is not None and capacity is not None:
        raise ValueError(f"{owner}: new_cache takes capacity= or tol= (certified eviction "
                         f"compacts a growing cache), not both; got capacity={capacity!r}, "
                         f"tol={tol!r}")
    if tol is None and ceilings:
        raise ValueError(f"{owner}: new_cache's {sorted(ceilings)} are certified eviction's; "
                         f"they need tol=")
    if capacity is None:
        cache = DecodeCache(model)
        if tol is not None:
            cache.eviction = eviction(model, tol, **ceilings)
        return cache
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"{owner}: capacity (the tokens a fixed-capacity cache holds per row) "
                         f"must be an int ≥ 1 or None; got {capacity!r}")
    max_len = getattr(model, "max_len", None)
    if getattr(model, "positions", None) is not None and capacity > max_len:
        raise ValueError(f"{owner}: capacity={capacity} exceeds max_len={max_len}, the "
                         f"positions that have an encoding")
    return FixedCache(model, capacity)


def read(layer, *inputs, cache, lengths=None, return_posterior=False, **options):
    """The outputs of ``x_new``'s tokens read after the cache's, the cache extended by them.

    Args:
        layer: the compiled causal layer (``structattn.compile(model)``).
        x_new (torch.Tensor): the new tokens ``(*batch, k, d_model)``, k ≥ 1; with
            ``lengths``, row b's first ``lengths[b]`` of them are real and the rest padding.
        cache (DecodeCache): the layer's cache (``layer.new_cache()``), extended in place.
        lengths (torch.Tensor | None): how many of each row's k tokens are real, an integer
            tensor of the batch shape with values in [0, k]; None: all k.
        return_posterior (bool): also return p(φ_i = j | x) ``(*batch, heads, k, P)`` of the
            new rows over the P = ``len(cache)`` parents cached after the call — P = the
            capacity for a fixed-capacity cache — (zero rows at padding, zero columns beyond
            a row's tokens).

    Returns:
        (torch.Tensor | tuple): ``(*batch, k, d_out)`` (zero at padding), and the posterior
            with ``return_posterior=True``.
    """
    model = layer.declaration
    owner = type(model).__name__
    rule = _rule(model, cache)
    x_new = _check_call(model, owner, inputs, options, cache, return_posterior)
    batch_shape, k = x_new.shape[:-2], x_new.shape[-2]
    cache.check_call(owner, x_new, batch_shape)
    if isinstance(cache, FixedCache) and not rule.tokens:  # x_new checked in the step
        x = x_new.reshape(-1, k, model.d_model)  # (B, k, d)
        counts = None if lengths is None else _counts(owner, lengths, batch_shape, k, x.device)
        return read_fixed(layer, rule, x, counts, cache, batch_shape, return_posterior)
    if checks_on() and not passes(x_new.isfinite().all()):
        raise ValueError(f"{owner}: x_new must be finite; got a NaN or an infinity")
    x = x_new.reshape(-1, k, model.d_model)  # (B, k, d)
    H = model.heads
    counts = _counts(owner, lengths, batch_shape, k, x.device)  # (B,)
    if lengths is not None:
        cache.rows_even = False  # rows may now hold different numbers of tokens
    # the values of hops 0..K−1 side by side (a multihop value, Σ_m w_m P^m V; else P V):
    # hop m + 1 of the new rows is their posterior times hop m of every row, written below
    weights = getattr(model, "hop_weights", (0.0, 1.0))
    hops, d_v = len(weights) - 1, model.d_v
    if rule.tokens:
        return _reread(layer, x, counts, cache, batch_shape, return_posterior)
    if cache.keys is None:
        cache.start(batch_shape, H, model.d_k, d_v * hops, x, rule.state)
    start = cache._lengths  # (B,)
    slot = torch.arange(k, device=x.device)
    # (B, k): the new tokens' slots in their rows; their positions are cache.offset later
    # (certified eviction; the priors it allows depend on distances alone, read on slots)
    pos = start[:, None] + slot
    ends = start + counts
    total = int(ends.max())
    if getattr(model, "positions", None) is not None and total + cache.offset > model.max_len:
        raise ValueError(f"{owner}: the cache would hold {total} tokens but positional "
                         f"encodings exist for max_len={model.max_len}")

    # (B, H, k, d_k), (B, H, k, d_k), (B, H, k, d_v)
    q, key, value = _project(model, x, pos + cache.offset, total + cache.offset)
    state = _new_state(rule, model, cache, x, start, counts) if rule.state else None
    cache.append(key, value if hops == 1 else
                 torch.cat([value] + [torch.zeros_like(value)] * (hops - 1), -1), state,
                 counts, total, total - k if cache.rows_even and hops == 1 else None)

    scale = _scale(model, q)
    parents = torch.arange(total, device=x.device)
    expected = post = None
    if cache.rows_even and not return_posterior and hops == 1 \
            and isinstance(rule, Normalised) and not isinstance(scale, torch.Tensor):
        expected = _attend(rule, model, q, scale, pos, parents, cache)  # one SDPA call
    if expected is None:  # (B, H, k, d_v): E[v_i]; (B, H, k, P)
        expected, post = _rows(rule, model, q, value, scale, pos, parents, counts, ends, cache,
                               weights)
    if cache.eviction is not None:  # certified eviction: check, report, evict
        cache.eviction.after_read(cache, q, key, start, counts, scale)
    y = merge_heads(expected)  # (B, k, H·d_v); zero at padding
    if model.W_o is not None:
        y = F.linear(y, model.W_o)
    y = y.reshape(*batch_shape, k, y.shape[-1])
    if return_posterior:
        return y, post.reshape(*batch_shape, *post.shape[1:])
    return y


def _rule(model, cache):
    """``rule_for(model)``, kept by the cache for the model's structure version (a cache
    serves one model: ``_check_call`` refuses another's)."""
    version = getattr(model, "structure_version", 0)
    kept = getattr(cache, "_rule", None) if isinstance(cache, DecodeCache) else None
    if kept is not None and kept[0] == version:
        return kept[1]
    rule = rule_for(model)
    if isinstance(cache, DecodeCache):
        cache._rule = (version, rule)
    return rule


def _reread(layer, x, counts, cache, batch_shape, return_posterior):
    """A model that reads its new tokens itself, as the last of their row (``Reread``):
    the cache keeps the tokens ``(B, 1, L, d_model)`` in its keys; each row with new tokens
    is read by ``model(tokens, last=count)``."""
    B, k, d = x.shape
    if cache.keys is None:
        cache.start(batch_shape, 1, d, 0, x, False)
    ends = cache._lengths + counts
    total = int(ends.max())
    cache.append(x[:, None], x.new_zeros(B, 1, k, 0), None, counts, total)
    cache.keys_read = total
    width = cache.capacity if isinstance(cache, FixedCache) else total  # the posterior's
    ys, posts = [], []
    for b in range(B):
        c, end = int(counts[b]), int(ends[b])
        if c == 0:
            ys.append(None)
            posts.append(None)
            continue
        y, post = layer.interpret(cache.keys[b:b + 1, 0, :end], last=c, return_posterior=True)
        ys.append(F.pad(y[0], (0, 0, 0, k - c)))  # (k, d_out)
        posts.append(F.pad(post[0], (0, width - end, 0, k - c)))  # (H, k, width)
    model = layer.declaration
    d_out = model.W_o.shape[0] if model.W_o is not None else model.heads * model.d_v
    zero_y, zero_p = x.new_zeros(k, d_out), x.new_zeros(model.heads, k, width)
    y = torch.stack([zero_y if t is None else t for t in ys]).reshape(*batch_shape, k, -1)
    if not return_posterior:
        return y
    post = torch.stack([zero_p if t is None else t for t in posts])
    return y, post.reshape(*batch_shape, *post.shape[1:])


def _check_call(model, owner, inputs, options, cache, return_posterior):
    """x_new, checked against the layer and the cache; a ValueError (TypeError) naming the
    argument otherwise."""
    if options or len(inputs) != 1:
        raise ValueError(f"{owner}: with cache=, the call takes x_new, lengths= and "
                         f"return_posterior=; got {len(inputs)} positional inputs and "
                         f"{sorted(options)}")
    (x_new,) = inputs
    if not isinstance(return_posterior, bool):
        raise TypeError(f"{owner}: return_posterior must be True or False; got "
                        f"{return_posterior!r}")
    if not isinstance(cache, DecodeCache):
        raise ValueError(f"{owner}: cache must be a DecodeCache made by layer.new_cache(); got "
                         f"{type(cache).__name__}")
    if not cache.owned_by(model):
        raise ValueError(f"{owner}: cache holds another layer's tokens (made by another "
                         f"layer's new_cache()); use this layer's new_cache()")
    d = model.d_model
    if not isinstance(x_new, torch.Tensor) or x_new.dim() < 2 or x_new.shape[-1] != d \
            or x_new.shape[-2] < 1 or not x_new.is_floating_point():
        got = shape_str(x_new.shape) + f" {x_new.dtype}" if isinstance(x_new, torch.Tensor) \
            else type(x_new).__name__
        raise ValueError(f"{owner}: x_new must be a floating-point tensor (*batch, k ≥ 1, "
                         f"d_model={d}); got {got}")
    W = model.W_q
    if x_new.dtype != W.dtype or x_new.device != W.device:
        raise ValueError(f"{owner}: x_new must have the parameters' dtype and device "
                         f"({W.dtype}, {W.device}); got ({x_new.dtype}, {x_new.device})")
    return x_new


def _new_state(rule, model, cache, x, start, counts):
    """The prior's state at the new tokens ``(B, H, k)``, continuing each row's last cached
    one (none before a row's first token)."""
    B, H = x.shape[0], model.heads
    last = (start - 1).clamp(min=0)  # each row's last cached token
    held = cache.state.gather(-1, last[:, None, None].expand(-1, H, 1))[..., 0] \
        if cache.state.shape[-1] else torch.zeros(B, H, dtype=x.dtype, device=x.device)
    held = torch.where((start > 0)[:, None], held, torch.zeros_like(held))
    return rule.new_state(model, x, counts, held)


def _expected(post, value, cache, weights, total):
    """E[v_i] of the new rows: Σ_m w_m (P^m V)_i (a plain value: weights (0, 1), P V). The
    cached values hold hops 0..K−1 side by side; hop m + 1 of the new rows is their
    posterior times hop m of every row, written into the cache as it is known."""
    d_v, hops = value.shape[-1], len(weights) - 1
    expected = value * weights[0] if weights[0] else None
    for m in range(1, hops + 1):
        hop = post @ cache.values[..., :total, (m - 1) * d_v:m * d_v]  # (P^m V) at the new rows
        if m < hops:
            cache.write_values(hop, slice(m * d_v, (m + 1) * d_v))
        if weights[m]:
            term = hop * weights[m] if weights[m] != 1.0 else hop
            expected = term if expected is None else expected + term
    return torch.zeros_like(value) if expected is None else expected


def _scale(model, q):
    """The scores' factor (a float, or a tensor on q's dtype and device)."""
    scale = Bilinear(model.W_q, model.W_k, heads=model.heads,
                     temperature=model.temperature).factor_scale()
    if isinstance(scale, torch.Tensor):
        scale = scale.to(dtype=q.dtype, device=q.device)
    return scale


def _rows(rule, model, q, value, scale, pos, parents, counts, ends, cache, weights):
    """E[v_i] ``(B, H, k, d_v)`` (zero at padding) and p(φ_i = j | x) ``(B, H, k, P)`` of the
    new rows, the posterior formed explicitly: rows of any lengths, any rule."""
    real = torch.arange(q.shape[-2], device=q.device)[None, :] < counts[:, None]  # (B, k)
    valid = (parents[None, None, :] < ends[:, None, None]) & real[:, :, None]  # (B, k, P)
    post = _posterior(rule, model, q, scale, pos, parents, valid, cache)
    expected = _expected(post, value, cache, weights, parents.numel())
    return expected.masked_fill(~real[:, None, :, None], 0.0), post


def _attend(rule, model, q, scale, pos, parents, cache):
    """E[v_i] ``(B, H, k, d_v)`` of the new rows as one ``scaled_dot_product_attention`` call
    over the P cached parents, the prior's log weight as its additive mask — where every row
    holds as many tokens and every new token is real (so ``valid`` is the support's own
    ``allowed``); None where some row would have no parent (the general reading's zero
    row)."""
    total = parents.numel()
    bias, allowed = rule.bias(model, pos, parents, None, cache, q.dtype)
    if not passes(allowed.any(-1).all()):
        return None
    mask = allowed if bias is None else bias.masked_fill(~allowed, float("-inf"))
    cache.keys_read = total
    return F.scaled_dot_product_attention(q, cache.keys[..., :total, :],
                                          cache.values[..., :total, :], attn_mask=mask,
                                          scale=scale)


def _posterior(rule, model, q, scale, pos, parents, valid, cache):
    """p(φ_i = j | x) ``(B, H, k, P)`` of the new rows over the P cached parents (stick-breaking
    newest first, stopping where the stick is spent); records ``cache.keys_read``."""
    keys = cache.keys[..., :parents.numel(), :]
    if isinstance(rule, Stick):
        post, cache.keys_read = read_backwards(q, keys, scale, pos, valid)
        return post
    scores = (q @ keys.transpose(-1, -2)) * scale  # (B, H, k, P)
    cache.keys_read = parents.numel()
    return rule.posterior(model, scores, pos, parents, valid, cache)

def _counts(owner, lengths, batch_shape, k, device) -> torch.Tensor:
    """Each row's real new tokens ``(B,)``: ``lengths`` checked, or k everywhere."""
    B = batch_shape.numel()
    if lengths is None:
        return torch.full((B,), k, dtype=torch.long, device=device)
    t = torch.as_tensor(lengths, device=device)
    if t.is_floating_point() or t.dtype == torch.bool or t.shape != batch_shape \
            or not (torch.compiler.is_compiling() or bool(((t >= 0) & (t <= k)).all())):
        raise ValueError(f"{owner}: lengths (the real new tokens of each row) must be an "
                         f"integer tensor of the batch shape {shape_str(batch_shape)} with "
                         f"values in [0, {k}]; got {t.dtype} {shape_str(t.shape)} "
                         f"{t.reshape(-1).tolist()[:8]}")
    return t.reshape(B).to(torch.long)
