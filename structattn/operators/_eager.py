"""``eager``: ``torch.compiler.disable`` applied on a function's first call, not at import.

Applying ``torch.compiler.disable`` imports ``torch._dynamo`` (over a second); a module
that only defines such functions should not make ``import structattn`` pay it. Under
``torch.compile`` the first traced call applies it (dynamo is loaded there anyway), and the
function runs eagerly, as with the decorator itself.
"""

from __future__ import annotations

import functools

import torch


def eager(fn):
    """``fn`` run outside ``torch.compile``'s graph (``torch.compiler.disable``), lazily."""
    disabled = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)
    return wrapper
