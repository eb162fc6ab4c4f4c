"""Predictive coding with attention (paper §4.4, appendix 7.2), and the standard network."""

from __future__ import annotations

import math

import torch
from torch import nn

import structattn as sa
from structattn.potentials.prediction_error import ACTIVATIONS


class PredictiveCoding(sa.Declaration):
    """Layers z_0 = x (observed), z_1 … z_L (latent, flat prior; z_L = y observed when given).

    - ``attention=True``: each unit i of layer l picks one incoming unit of layer l − 1,
      φ_li ~ Uniform, with ψ(z_j, z_i) = −(k/2)(z_i − w_ij f(z_j) − b_i)²
      (``PredictionError``): F = −Σ_{l,i} log (1/n_{l−1}) Σ_j exp ψ_ij, whose gradient weighs
      each unit's prediction errors by a softmax over them.
    - ``attention=False`` (the standard, precision-weighted network, the baseline): the node
      energy E_l = (k/2)‖z_l − W_l f(z_{l−1}) − b_l‖² per layer (``structattn.energy``).

    Inference: gradient steps on F for the latent layers (``steps``, ``step_size``), from the
    prediction under the prior (``attention``: the mean of the single-edge predictions,
    (1/n) Σ_j w_ij f(z_j) + b_i; standard: W f(z) + b). Learning: the gradient of F with
    respect to W, b at the relaxed states (``free_energy``) — the local rule.

    x: ``(*batch, n_0)``, y: ``(*batch, n_L)`` (optional) → the top layer ``(*batch, n_L)``
    (inferred, or y). Parameters ``weights[l−1]``: ``(n_l, n_{l−1})``, ``biases[l−1]``: ``(n_l,)``.

    ::

        layer l      z_i              φ_li ~ Uniform(layer l − 1): one incoming unit
                    / | \\
        layer l−1  z_1 … z_n          ψ = −(k/2)(z_i − w_ij f(z_j) − b_i)²
    """

    def __init__(self, layer_sizes, *, attention=True, precision=1.0, activation="tanh",
                 steps=20, step_size=0.1, grad="unroll", device=None, dtype=None):
        super().__init__()
        sizes = list(layer_sizes) if isinstance(layer_sizes, (list, tuple)) else None
        if not sizes or len(sizes) < 2 or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes):
            raise ValueError(f"PredictiveCoding: layer_sizes must be a list of ≥ 2 positive ints "
                             f"(input first); got {layer_sizes!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"PredictiveCoding: activation must be one of {list(ACTIVATIONS)}; "
                             f"got {activation!r}")
        sa.potentials.bilinear.check_temperature(precision, "PredictiveCoding (precision)")
        sa.IterationOptions(steps=steps, update="gradient", step_size=step_size, grad=grad)
        kw = {"device": device, "dtype": dtype}
        self.layer_sizes, self.attention, self.precision = sizes, bool(attention), precision
        self.activation, self.steps, self.step_size, self.grad = activation, steps, step_size, grad
        self.f = ACTIVATIONS[activation][0]
        pairs = zip(sizes, sizes[1:], strict=False)  # (n_{l−1}, n_l)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(n, m, **kw) / math.sqrt(m)) for m, n in pairs)
        self.biases = nn.ParameterList(nn.Parameter(torch.zeros(n, **kw)) for n in sizes[1:])

    def predict(self, l: int, below: torch.Tensor) -> torch.Tensor:
        """Layer l's prediction under the prior from layer l − 1's states ``(*batch, n_{l−1})``."""
        W, b = self.weights[l - 1], self.biases[l - 1]
        fz = self.f(below)
        return (fz @ W.T) / (W.shape[1] if self.attention else 1) + b

    def model(self, x, y=None):
        L = len(self.layer_sizes) - 1
        self._check(x, y)
        below = sa.nodes("layer0", x.unsqueeze(-1), features=1)
        state, latents = x, []
        for l in range(1, L + 1):
            guess = self.predict(l, state)
            if l == L and y is not None:
                layer = sa.nodes(f"layer{l}", y.unsqueeze(-1), features=1)
                state = y
            else:
                layer = sa.latent(f"layer{l}", guess.unsqueeze(-1), scale=None,
                                  update="gradient", steps=self.steps, step_size=self.step_size,
                                  grad=self.grad)
                latents.append(layer)
                state = guess
            W, b = self.weights[l - 1], self.biases[l - 1]
            if self.attention:
                phi = sa.edges(f"predict{l}", layer, below, sa.priors.Uniform())
                sa.potential(phi, sa.potentials.PredictionError(
                    W, b, precision=self.precision, activation=self.activation))
            else:
                sa.energy(f"predict{l}", self._gaussian_error(W, b), layer, below)
            below = layer
        sa.infer(*latents)
        return below.states[..., 0]

    def _gaussian_error(self, W, b):
        k, f = self.precision, self.f

        def energy(z, z_below):  # (k/2)‖z − W f(z_below) − b‖² per batch element
            e = z[..., 0] - f(z_below[..., 0]) @ W.T - b
            return 0.5 * k * (e * e).sum(-1)
        return energy

    def _check(self, x, y):
        n0, nL = self.layer_sizes[0], self.layer_sizes[-1]
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != n0:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"PredictiveCoding: x must have shape (*batch, {n0}); got {got}")
        if y is not None and (not isinstance(y, torch.Tensor) or y.shape != (*x.shape[:-1], nL)):
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ValueError(f"PredictiveCoding: y must have shape {(*x.shape[:-1], nL)} "
                             f"(x's batch, {nL} output units); got {got}")

    def example_inputs(self, n=None, batch=1):
        return (self._randn(batch, self.layer_sizes[0]),)


def predictive_coding(layer_sizes, **kwargs) -> PredictiveCoding:
    """A predictive-coding network with attention over incoming units (``attention=True``) or
    the standard precision-weighted one; see :class:`PredictiveCoding`."""
    return PredictiveCoding(layer_sizes, **kwargs)
