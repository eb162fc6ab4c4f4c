"""``FixedCache``: a ``DecodeCache`` of a fixed capacity, preallocated and written in place, so
that a decoding step's tensors have the same shapes at every length (``layer.new_cache(
capacity=L)``)."""

from __future__ import annotations

import torch

from .cache import DecodeCache


class FixedCache(DecodeCache):
    """Room for ``capacity`` tokens per row, allocated by the first call and never resized:
    keys ``(B, H, capacity, d_k)``, values ``(B, H, capacity, d_v)`` and the prior's state
    ``(B, H, capacity)`` are views of storage with one slot more, the *spare* slot, where a
    step writes its padding (a row's new tokens beyond its ``lengths``), so that every step
    writes k slots per row whatever its lengths. Row b's tokens are slots ``< lengths[b]``;
    a step reads every slot and masks the rest out (``structattn.decoding.step``). The
    state's storage has one slot more in front, slot 0, which holds 0: token j's state is
    at slot j + 1, so that the state a row continues from is at its length, 0 when empty.

    Without gradients every write is in place (the tensors keep their storage); where
    gradients flow through a cached tensor, a write copies it (an earlier call's graph may
    have saved it), into a tensor of the same shape. ``lengths`` is a new tensor after each
    call.
    """

    def __init__(self, owner, capacity: int):
        super().__init__(owner)
        self.capacity = capacity
        self._stores: list | None = None  # [keys, values, state | None], capacity + 1 slots
        #: an upper bound on every row's length, known without reading ``lengths`` (the sum
        #: of the calls' k); None where a call under torch.compile did not keep it
        self._bound: int | None = 0
        self._steps = None  # the layer's ``StepReading`` that read this cache's steps

    @property
    def plans(self) -> dict:
        """The recorded ``Plan`` per signature of the steps read with this cache (the
        layer's, shared by its caches of this capacity; a step after the first two of a
        signature records nothing); empty for a model read eagerly (expanding attention's
        mean field)."""
        return {} if self._steps is None else {**self._steps.plans.plans,
                                               **self._steps.plans.dynamic_plans}

    def __repr__(self) -> str:
        return super().__repr__().replace("DecodeCache(", f"DecodeCache(capacity={self.capacity}, ", 1)

    # -- storage --------------------------------------------------------------------------
    def start(self, batch_shape: torch.Size, heads: int, d_k: int, d_v: int, like: torch.Tensor,
              state: bool) -> None:
        """Allocate the storage of ``capacity`` + 1 slots (the spare last; the state's
        + 2, the first 0) for the first call."""
        B, L = batch_shape.numel(), self.capacity + 1
        kw = {"dtype": like.dtype, "device": like.device}
        self.batch_shape = batch_shape
        self.stores = [torch.zeros(B, heads, L, d_k, **kw), torch.zeros(B, heads, L, d_v, **kw),
                       torch.zeros(B, heads, L + 1, **kw) if state else None]
        self._lengths = torch.zeros(B, dtype=torch.long, device=like.device)

    @property
    def stores(self) -> list:
        """The storage ``[keys, values, state | None]``, each with the spare slot (the state
        with slot 0 too)."""
        return self._stores

    @stores.setter
    def stores(self, stores: list) -> None:
        keys, values, state = stores
        held = self._stores
        if held is not None and keys is held[0] and values is held[1] and state is held[2]:
            return  # written in place: the views stand
        self._stores = [keys, values, state]
        self.keys = keys[..., :self.capacity, :]
        self.values = values[..., :self.capacity, :]
        self.state = None if state is None else state[..., 1:self.capacity + 1]

    # -- the capacity ---------------------------------------------------------------------
    def make_room(self, owner: str, k: int, counts: torch.Tensor | None) -> None:
        """Refuse a call whose tokens would not fit, in one line naming ``capacity``: known
        from the bound on the lengths without reading them, read only when the bound leaves
        it open (``counts``: each row's real new tokens, None: k everywhere)."""
        if self._bound is not None and self._bound + k <= self.capacity:
            self._bound += k
            return
        new = k if counts is None else counts
        longest = int((self._lengths + new).max()) if self._lengths is not None else k
        if longest > self.capacity:
            raise ValueError(f"{owner}: the cache would hold {longest} tokens in a row, beyond "
                             f"its capacity={self.capacity} (layer.new_cache(capacity=…))")
        self._bound = longest

    def append(self, keys: torch.Tensor, values: torch.Tensor, state: torch.Tensor | None,
               counts: torch.Tensor, total: int) -> None:
        """The eager reading's append (a model that reads its tokens itself): row b's first
        ``counts[b]`` new tokens written after its ``lengths[b]``, the rest to the spare slot."""
        if total > self.capacity:
            raise ValueError(f"the cache would hold {total} tokens in a row, beyond its "
                             f"capacity={self.capacity} (layer.new_cache(capacity=…))")
        if state is not None:  # (no model that reads its tokens itself carries a state)
            raise NotImplementedError("FixedCache.append keeps no per-token state")
        at = slots(self._lengths, counts, keys.shape[-2], self.capacity)
        new = (keys, values, state)
        self.stores = [None if s is None else write(s, at, n)
                       for s, n in zip(self.stores, new, strict=True)]
        self._lengths = self._lengths + counts
        self._bound = None if self._bound is None else max(self._bound, total)


def slots(lengths: torch.Tensor, counts: torch.Tensor, k: int, capacity: int) -> torch.Tensor:
    """Where each of k new tokens goes ``(B, k)``: row b's real ones after its ``lengths[b]``
    tokens, its padding (slots ≥ ``counts[b]``) to the spare slot ``capacity``."""
    slot = torch.arange(k, device=lengths.device)
    return torch.where(slot < counts[:, None], lengths[:, None] + slot, capacity)


def write(store: torch.Tensor, at: torch.Tensor, new: torch.Tensor, index=None
          ) -> torch.Tensor:
    """``store[b, :, at[b, s]] = new[b, :, s]`` (``store (B, H, L, …)``, ``new (B, H, k, …)``):
    in place when no gradient flows through either, else into a copy. Several writes to the
    spare slot in one call leave any one of them there: it is never read. ``index``: ``at``
    as ``scatter``'s index for ``new``'s shape (``scatter_index``), where a caller writing
    several tensors of one shape made it once."""
    copy = torch.is_grad_enabled() and (store.requires_grad or new.requires_grad)
    if torch.compiler.is_compiling():  # inductor writes an index_put_ in place (a scatter_
        # into an input it copies whole)
        rows = torch.arange(at.shape[0], device=at.device)[:, None]  # (B, 1): broadcast
        where = [rows, None, at]  # store[rows, :, at] ← new (B, k, H, …)
        if copy:
            return torch.ops.aten.index_put(store, where, new.transpose(1, 2))
        torch.ops.aten.index_put_(store, where, new.transpose(1, 2))
        return store
    # eagerly, one scatter (an index_put_ wraps its indices first: two kernels more)
    if index is None:
        index = scatter_index(at, new)
    return store.scatter(2, index, new) if copy else store.scatter_(2, index, new)


def scatter_index(at: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``at (B, k)`` expanded to ``new``'s shape ``(B, H, k, …)``: ``write``'s scatter index."""
    B, H, k = new.shape[:3]
    return at.view(B, 1, k, *(1,) * (new.dim() - 3)).expand(new.shape)
