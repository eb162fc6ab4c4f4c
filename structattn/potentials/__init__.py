"""Edge potentials ψ(x_j, x_i). One class per file."""

from .base import Potential as Potential
from .bilinear import Bilinear as Bilinear
from .distance import Distance as Distance
from .dot import DotProduct as DotProduct
from .mapped import Mapped as Mapped
from .positional import Positional as Positional
from .positional import sinusoidal as sinusoidal
from .prediction_error import PredictionError as PredictionError
from .rotary import Rotary as Rotary
from .squared_distance import SquaredDistance as SquaredDistance
