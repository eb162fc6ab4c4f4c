"""Value functions v_i(x, φ_i). One class per file."""

from .base import Value as Value
from .linear import Linear as Linear
