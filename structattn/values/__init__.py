"""Value functions v_i(x, φ). One class per file."""

from .base import Value as Value
from .base import value_term as value_term
from .hops import Hops as Hops
from .identity import Identity as Identity
from .linear import Linear as Linear
