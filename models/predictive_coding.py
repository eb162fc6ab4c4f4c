"""Predictive coding with attention (paper §4.4, appendix 7.2), and the standard network."""

from __future__ import annotations

import math

import torch
from torch import nn

import structattn as sa
from structattn.checks import check_layer_sizes, check_size
from structattn.potentials.prediction_error import ACTIVATIONS

from ._catalogue import Entry, randn64


class PredictiveCoding(sa.Declaration):
    r"""Layers $z_0 = x$ (observed), $z_1 … z_L$ (latent, flat prior; $z_L = y$ observed when given).

    - ``attention=True``: each node i of layer l picks one incoming node of layer l − 1,
      $φ_{li} ∼ \mathrm{Uniform}$, with $ψ(z_j, z_i) = −\tfrac{k}{2}‖z_i − W_{ij} f(z_j) − b_i‖²$
      (``PredictionError``): $F = −\sum_{l,i} \log \frac{1}{P_{l−1}} \sum_j \exp ψ_{ij}$, whose
      gradient weighs each node's prediction errors by a softmax over them. A node is a unit (the paper's
      derivation, the default) or, with ``blocks=[B_0, …, B_L]``, one of B_l equal blocks of
      layer l's units (blocks of units competing, the paper's suggestion): ``blocks=[1, 4, 1]``
      makes the output layer pick one of four hidden blocks, each predicted from the whole
      input. With one block per layer there is one edge to choose and F is the standard
      network's.
    - ``attention=False`` (the standard, precision-weighted network, the baseline): the node
      energy $E_l = \tfrac{k}{2}‖z_l − W_l f(z_{l−1}) − b_l‖²$ per layer (``structattn.energy``).

    Inference: gradient steps on F for the latent layers (``steps``, ``step_size``), from the
    prediction under the prior (``attention``: the mean of the single-edge predictions,
    (1/P) Σ_j W_ij f(z_j) + b_i; standard: W f(z) + b). Learning: the gradient of F with
    respect to W, b at the relaxed states (``free_energy``) — the local rule.

    x: ``(*batch, n_0)``, y: ``(*batch, n_L)`` (optional) → the top layer ``(*batch, n_L)``
    (inferred, or y). Parameters ``weights[l−1]``: units ``(n_l, n_{l−1})`` (also the standard
    network's), blocks ``(B_l, B_{l−1}, n_l/B_l, n_{l−1}/B_{l−1})``; ``biases[l−1]``: units
    ``(n_l,)``, blocks ``(B_l, n_l/B_l)``. Weights start at N(0, 1/n_{l−1}) in every reading.
    Layer l's node set has states ``(*batch, B_l, n_l/B_l)`` (units: ``(*batch, n_l, 1)``).

    ::

        layer l      z_i              φ_li ~ Uniform(layer l − 1): one incoming unit
                    / | \
        layer l−1  z_1 … z_n          ψ = −(k/2)(z_i − w_ij f(z_j) − b_i)²

    Args:
        layer_sizes (list[int]): [n_0, …, n_L], the layers' widths, input first: a list or
            tuple of ≥ 2 positive ints.
        attention (bool): True (default): each node picks one incoming node of the layer
            below (``PredictionError``); False: the standard network's node energies.
        blocks (list[int] | None): None (default): one node per unit; [B_0, …, B_L]: one
            positive int per layer, B_l dividing n_l, the number of equal blocks (nodes) of
            layer l. Only with ``attention=True``.
        precision (float | torch.Tensor): k, the prediction errors' precision: a finite
            number > 0 (or a tensor). Default 1.0.
        activation (str | None): f, applied to the layer below before its prediction:
            ``"tanh"`` (default) or None (the identity).
        steps (int): the number of gradient steps on F for each latent layer, an int ≥ 0.
            Default 20.
        step_size (float): η of those steps, a finite number > 0. Default 0.1.
        grad (str): ``"unroll"`` (default: back-propagate through every step) or ``"last"``
            (iterate without gradients, then one differentiable step).
        device (torch.device | str | None): where the parameters live; None: torch's default.
        dtype (torch.dtype | None): the parameters' dtype; None: torch's default.
    """

    def __init__(self, layer_sizes, *, attention=True, blocks=None, precision=1.0,
                 activation="tanh", steps=20, step_size=0.1, grad="unroll", device=None,
                 dtype=None):
        super().__init__()
        sizes = check_layer_sizes("PredictiveCoding", layer_sizes, "input first")
        steps = check_size("PredictiveCoding", "steps", steps, 0)
        if activation not in ACTIVATIONS:
            raise ValueError(f"PredictiveCoding: activation must be one of {list(ACTIVATIONS)}; "
                             f"got {activation!r}")
        self.blocks = self._check_blocks(blocks, sizes, attention)
        sa.potentials.bilinear.check_temperature(precision, "PredictiveCoding (precision)")
        sa.IterationOptions(steps=steps, update="gradient", step_size=step_size, grad=grad)
        kw = {"device": device, "dtype": dtype}
        self.layer_sizes, self.attention, self.precision = sizes, bool(attention), precision
        self.activation, self.steps, self.step_size, self.grad = activation, steps, step_size, grad
        self.f = ACTIVATIONS[activation][0]
        self.weights, self.biases = nn.ParameterList(), nn.ParameterList()
        for l in range(1, len(sizes)):
            C, P = self.blocks[l], self.blocks[l - 1]
            shape = (C, P) if self._units(l) else (C, P, sizes[l] // C, sizes[l - 1] // P)
            self.weights.append(nn.Parameter(torch.randn(shape, **kw) / math.sqrt(sizes[l - 1])))
            self.biases.append(nn.Parameter(torch.zeros(shape[:1] + shape[2:3], **kw)))

    @staticmethod
    def _check_blocks(blocks, sizes, attention):
        if blocks is None:
            return list(sizes)  # one node per unit
        if not attention:
            raise ValueError("PredictiveCoding: blocks are nodes that compete for a child, an "
                             "attention=True setting; the standard network connects whole layers")
        ok = isinstance(blocks, (list, tuple)) and len(blocks) == len(sizes)
        if ok:
            blocks = [check_size("PredictiveCoding", f"blocks[{l}]", B)
                      for l, B in enumerate(blocks)]
            ok = all(n % B == 0 for B, n in zip(blocks, sizes, strict=True))
        if not ok:
            raise ValueError(f"PredictiveCoding: blocks must give, for each of the "
                             f"{len(sizes)} layers {sizes}, a positive number of equal blocks "
                             f"dividing its size; got {blocks!r}")
        return list(blocks)

    def _units(self, l: int) -> bool:
        """Layer l and the one below are scalar units (the paper's derivation), or standard."""
        return not self.attention or (self.blocks[l] == self.layer_sizes[l]
                                      and self.blocks[l - 1] == self.layer_sizes[l - 1])

    def _nodes(self, l: int, flat: torch.Tensor) -> torch.Tensor:
        """``(*batch, n_l)`` → layer l's node states ``(*batch, B_l, n_l/B_l)``."""
        B = self.blocks[l]
        return flat.unflatten(-1, (B, flat.shape[-1] // B))

    def predict(self, l: int, below: torch.Tensor) -> torch.Tensor:
        """Layer l's prediction under the prior from layer l − 1's states ``(*batch, n_{l−1})``:
        ``(*batch, n_l)``."""
        W, b = self.weights[l - 1], self.biases[l - 1]
        fz = self.f(below)
        if not self.attention:
            return fz @ W.T + b
        if self._units(l):
            return (fz @ W.T) / W.shape[1] + b
        P = W.shape[1]
        pred = torch.einsum("cpkd,...pd->...ck", W, fz.unflatten(-1, (P, -1))) / P + b
        return pred.flatten(-2)

    def model(self, x, y=None):
        L = len(self.layer_sizes) - 1
        self.check_inputs(x=x, y=y)
        self.check_finite_inputs(x=x, y=y)
        self._check(x, y)
        below = sa.nodes("layer0", self._nodes(0, x))
        state, latents = x, []
        for l in range(1, L + 1):
            guess = self.predict(l, state)
            if l == L and y is not None:
                layer = sa.nodes(f"layer{l}", self._nodes(l, y))
                state = y
            else:
                layer = sa.latent(f"layer{l}", self._nodes(l, guess), scale=None,
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
        return below.states.flatten(-2)

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
    """A predictive-coding network with attention over incoming units or blocks of units
    (``attention=True``, ``blocks=``) or the standard precision-weighted one; see
    ``PredictiveCoding``."""
    return PredictiveCoding(layer_sizes, **kwargs)


def _case():
    m = predictive_coding([5, 4, 3], steps=3, step_size=0.2, dtype=torch.float64)
    return m, (randn64(2, 5),)


#: the catalogue's statement (structattn/models/_catalogue.py)
ENTRY = Entry(predictive_coding, PredictiveCoding, case=_case,
              example=dict(layer_sizes=[6, 4, 3], steps=10),
              sizes=dict(layer_sizes=1, steps=0))
