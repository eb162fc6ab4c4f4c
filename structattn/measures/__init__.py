"""The exponential-family view (SPEC "Exponential-family view"): intrinsic measures h, their
log-normalisers G(η) = log ∫ h(x) e^{⟨x, η⟩} dx (energies) and ∇G (attention outputs),
residual attention dynamics, the contrastive reading and a GPB2 collapse."""

from .base import Measure as Measure
from .contrastive import info_nce as info_nce
from .dynamics import renormalise as renormalise
from .dynamics import residual_dynamics as residual_dynamics
from .empirical import Empirical as Empirical
from .gaussian import Gaussian as Gaussian
from .gaussian import GaussianMixture as GaussianMixture
from .gpb2 import gpb2_collapse as gpb2_collapse
