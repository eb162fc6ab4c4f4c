"""Edge priors: p(φ_i = j). One class per file."""

from .base import Prior as Prior
from .beta_geometric import BetaGeometric as BetaGeometric
from .categorical import Categorical as Categorical
from .forgetting import ForgettingGate as ForgettingGate
from .generalised_gaussian import GeneralisedGaussian as GeneralisedGaussian
from .relative import ALiBi as ALiBi
from .relative import RelativePosition as RelativePosition
from .stick_breaking import StickBreaking as StickBreaking
from .uniform import Uniform as Uniform
