"""Edge priors: p(φ_i = j). One class per file."""

from .base import Prior as Prior
from .categorical import Categorical as Categorical
from .uniform import Uniform as Uniform
