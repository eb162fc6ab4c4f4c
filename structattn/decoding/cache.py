"""``DecodeCache``: what a causal layer has read so far, per batch row — its keys, values and
the prior's running state — so that the next tokens are read against it."""

from __future__ import annotations

import weakref

import torch

from ..checking._validation import shape_str


class DecodeCache:
    """The tokens a causal layer has read, row by row: keys ``(B, H, L, d_k)`` (rotated, for
    rotary positions), values ``(B, H, L, d_v)`` and, for a prior that carries one, its state
    per token (``state``, e.g. FoX's running sum of log forget gates ``(B, H, L)``); row b
    holds its first ``lengths[b]`` tokens, the rest of its L slots is free. A model that
    reads its new tokens itself (expanding attention's mean-field windows) keeps the tokens
    as its keys, ``(B, 1, L, d_model)``, and no values.

    Made empty by ``layer.new_cache()``; the first call with it fixes the batch shape, dtype
    and device. ``len(cache)`` is the number of tokens a row holds — the longest row's when
    the rows differ (``lengths`` holds each row's, shaped like the batch).
    """

    #: a ``FixedCache``'s generated call ``layer(x_new, cache=self)``: that of the plan that
    #: served its last step (``structattn.plans.fast_path.CacheStep``), which the layer tries
    #: first; a growing cache has none
    _step = None

    def __init__(self, owner):
        self._owner = weakref.ref(owner)  # the declaration whose parameters made the keys
        self.batch_shape: torch.Size | None = None
        self.keys: torch.Tensor | None = None  # (B, H, capacity, d_k)
        self.values: torch.Tensor | None = None  # (B, H, capacity, d_v)
        self.state: torch.Tensor | None = None  # (B, H, capacity) where the prior carries one
        self._lengths: torch.Tensor | None = None  # (B,) long
        #: how many cached tokens per row the last call's new tokens read (scored): every one
        #: but where stick-breaking's stick was spent before (``structattn.decoding.stick``)
        self.keys_read = 0
        self.offset = 0  # tokens evicted from the front of every row (slot s: position offset + s)
        self.eviction = None  # the ``Eviction`` policy of new_cache(tol=…), or None
        #: whether every row holds as many tokens (no call has given lengths=): a step then
        #: reads its rows as one SDPA call (``read._attend``)
        self.rows_even = True

    # -- what it holds --------------------------------------------------------------------
    def __len__(self) -> int:
        return 0 if self._lengths is None or self._lengths.numel() == 0 \
            else int(self._lengths.max())

    @property
    def lengths(self) -> torch.Tensor | None:
        """How many tokens each row holds, a long tensor of the batch shape (None: empty)."""
        return None if self._lengths is None else self._lengths.reshape(self.batch_shape)

    @property
    def evicted(self) -> int:
        """How many of each row's first tokens certified eviction has dropped (0 without tol)."""
        return self.offset

    @property
    def trace(self) -> list | None:
        """One ``EvictionStep`` per call (tokens held, the bound on the evicted mass, whether
        it is proved), with ``new_cache(tol=…)``; else None."""
        return None if self.eviction is None else self.eviction.trace

    @property
    def dtype(self) -> torch.dtype | None:
        return None if self.keys is None else self.keys.dtype

    @property
    def device(self) -> torch.device | None:
        return None if self.keys is None else self.keys.device

    def owned_by(self, declaration) -> bool:
        return self._owner() is declaration

    def __repr__(self) -> str:
        if self.keys is None:
            return "DecodeCache(empty)"
        return (f"DecodeCache(batch={tuple(self.batch_shape)}, tokens={len(self)}, "
                f"heads={self.keys.shape[1]}, dtype={self.dtype}, device={self.device})")

    # -- checks ---------------------------------------------------------------------------
    def check_call(self, owner: str, x: torch.Tensor, batch_shape: torch.Size) -> None:
        """Refuse inputs that do not continue this cache: another batch shape, dtype or
        device than the calls it holds."""
        if self.keys is None:
            return
        if batch_shape != self.batch_shape:
            raise ValueError(f"{owner}: x_new's batch shape must be the cache's, "
                             f"{shape_str(self.batch_shape)}; got {shape_str(batch_shape)}")
        if x.dtype != self.dtype or x.device != self.device:
            raise ValueError(f"{owner}: x_new must have the cache's dtype and device "
                             f"({self.dtype}, {self.device}); got ({x.dtype}, {x.device})")

    # -- appending ------------------------------------------------------------------------
    def start(self, batch_shape: torch.Size, heads: int, d_k: int, d_v: int, like: torch.Tensor,
              state: bool) -> None:
        """Make the empty storage of a first call (capacity 0)."""
        B = batch_shape.numel()
        kw = {"dtype": like.dtype, "device": like.device}
        self.batch_shape = batch_shape
        self.keys = torch.zeros(B, heads, 0, d_k, **kw)
        self.values = torch.zeros(B, heads, 0, d_v, **kw)
        self.state = torch.zeros(B, heads, 0, **kw) if state else None
        self._lengths = torch.zeros(B, dtype=torch.long, device=like.device)

    def append(self, keys: torch.Tensor, values: torch.Tensor, state: torch.Tensor | None,
               counts: torch.Tensor, total: int, even: int | None = None) -> None:
        """Write row b's first ``counts[b]`` new tokens (``keys (B, H, k, d_k)``, ``values``,
        ``state (B, H, k)``) after its ``lengths[b]``; ``total`` = max(lengths + counts);
        ``even``: every row's length, where they are equal and every new token is real.
        The storage doubles when it is full, and is written in place unless gradients flow
        (then each call copies it: ``_put``)."""
        if total > self.keys.shape[-2]:
            capacity = max(total, 2 * self.keys.shape[-2])
            self.keys = _grow(self.keys, capacity, -2)
            self.values = _grow(self.values, capacity, -2)
            if self.state is not None:
                self.state = _grow(self.state, capacity, -1)
        k = keys.shape[-2]
        if even is not None and not torch.is_grad_enabled():
            # every row holds ``even`` tokens and takes all k: one slice each, in place
            self.keys[..., even:even + k, :] = keys
            self.values[..., even:even + k, :] = values
            if self.state is not None:
                self.state[..., even:even + k] = state
            self._lengths = self._lengths + k
            self._written = None
            return
        slot = torch.arange(k, device=keys.device)
        real = slot < counts[:, None]  # (B, k)
        rows, new = real.nonzero(as_tuple=True)
        at = self._lengths[rows] + new  # where each real new token goes
        # out of place: a cached tensor may be part of an autograd graph
        self.keys = _put(self.keys, rows, at, keys[rows, :, new])
        self.values = _put(self.values, rows, at, values[rows, :, new])
        if self.state is not None:
            self.state = _put(self.state, rows, at, state[rows, :, new])
        self._lengths = self._lengths + counts
        self._written = (rows, new, at)

    def write_values(self, values: torch.Tensor, block: slice) -> None:
        """Overwrite the features ``block`` of the values the last ``append`` wrote with
        ``values (B, H, k, width)``: a multihop value's next hop, known only once the new
        rows' posterior is."""
        rows, new, at = self._written
        moved = self.values.movedim(1, 2)  # (B, L, H, d)
        held = moved[rows, at]  # (E, H, d)
        held = torch.cat([held[..., :block.start], values[rows, :, new],
                          held[..., block.stop:]], -1)
        self.values = _put(self.values, rows, at, held)


    # -- eviction -------------------------------------------------------------------------
    def drop_front(self, n: int) -> None:
        """Drop every row's first ``n`` held tokens (certified eviction's compaction): a view,
        so the storage is reclaimed when it next grows."""
        self.keys = self.keys[..., n:, :]
        self.values = self.values[..., n:, :]
        if self.state is not None:
            self.state = self.state[..., n:]
        self._lengths = self._lengths - n
        self.offset += n


def _grow(t: torch.Tensor, capacity: int, dim: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = capacity - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim)


def _put(store: torch.Tensor, rows: torch.Tensor, at: torch.Tensor, new: torch.Tensor):
    """``store[rows, :, at] = new``, ``new (E, H, …)``: in place when no gradient flows
    through either; else out of place (a copy), since an earlier call's graph may have saved
    ``store`` for its backward."""
    moved = store.movedim(1, 2)  # (B, L, H, …)
    if torch.is_grad_enabled() and (store.requires_grad or new.requires_grad):
        return moved.index_put((rows, at), new).movedim(2, 1)
    moved.index_put_((rows, at), new)
    return store
