"""Ground truth from the same declaration, through Pyro: exact enumeration and comparisons."""

from .compare import Comparison as Comparison
from .compare import compare as compare
from .exact import ExactPosterior as ExactPosterior
from .exact import exact as exact
from .sample import PosteriorSamples as PosteriorSamples
from .sample import sample as sample
