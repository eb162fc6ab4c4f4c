"""Ground truth from the same declaration, through Pyro: exact enumeration and comparisons."""

from .compare import Comparison as Comparison
from .compare import compare as compare
from .exact import ExactPosterior as ExactPosterior
from .exact import exact as exact
from .map import MAPEstimate as MAPEstimate
from .map import map_estimate as map_estimate
from .sample import PosteriorSamples as PosteriorSamples
from .sample import sample as sample
