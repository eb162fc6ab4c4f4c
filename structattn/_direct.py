"""The readers entered directly (without Pyro's handler stack) by compiled modules.

The declaration primitives look here first; when no reader is active they send Pyro
messages as usual. Per thread, so replicas run by ``nn.DataParallel`` in threads do
not see each other's readers.
"""

from __future__ import annotations

import threading

_local = threading.local()


def direct_readers() -> list:
    """This thread's stack of directly entered readers (innermost last)."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack
