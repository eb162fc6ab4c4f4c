"""Decoding with a cache: a causal layer reads new tokens after the ones it has read.

``cache = layer.new_cache()`` makes an empty ``DecodeCache``; ``layer(x_new, cache=cache)``
reads x_new's tokens after everything the cache holds, appends their keys, values and the
prior's state, and returns the new tokens' outputs (prefill and steps alike). Rows of a batch
may hold different numbers of tokens (``lengths=``). ``layer.new_cache(tol=ε, …)`` evicts the
oldest tokens once their posterior mass is proved ≤ ε for every later query (``evict``:
``EvictionStep`` per call in ``cache.trace``, ``EvictionWarning`` when a token breaks the
ceilings). See ``read`` and docs/guide/decoding.md.
"""

from .cache import DecodeCache
from .evict import EvictionStep, EvictionWarning
from .read import new_cache, read

__all__ = ["DecodeCache", "EvictionStep", "EvictionWarning", "new_cache", "read"]
