"""Ground truth from the same declaration, through Pyro: exact enumeration, MAP, SVI, MCMC,
predictive draws, ArviZ, and comparisons with a verdict."""

from .compare import Comparison as Comparison
from .compare import compare as compare
from .draws import Draws as Draws
from .exact import ExactPosterior as ExactPosterior
from .exact import exact as exact
from .map import MAPEstimate as MAPEstimate
from .map import map_estimate as map_estimate
from .mcmc import mcmc as mcmc
from .predictive import predictive as predictive
from .sample import PosteriorSamples as PosteriorSamples
from .sample import sample as sample
from .svi import SVIResult as SVIResult
from .svi import svi as svi
