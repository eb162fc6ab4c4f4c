"""The stack of readers entered directly (without Pyro's handler stack) by compiled modules.

The declaration primitives look here first; when empty they send Pyro messages as usual.
"""

DIRECT: list = []
