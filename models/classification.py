"""A classification layer as attention (paper Table 1): outputs pick a class embedding."""

from __future__ import annotations

import math

import torch
from torch import nn

from structattn.checks import check_size
from structattn.compiler import compile as compile_model
from structattn.declaration import Declaration
from structattn.family import edges, potential
from structattn.family import value as expect
from structattn.nodes import nodes
from structattn.potentials import DotProduct
from structattn.potentials.bilinear import check_temperature
from structattn.priors import Uniform
from structattn.values import Identity

from ._catalogue import Entry, randn64


class Classification(Declaration):
    r"""$φ_i ∼ \mathrm{Uniform}(\text{classes})$; $ψ(y_j, f_i) = f_iᵀ y_j / τ$; $v = y_j$.

    The edge posterior p(φ_i = j | f) = softmax_j(f_iᵀ y_j / τ) *is* the class
    distribution, so −log p(φ_i = c_i | f) is the cross-entropy of the logits f Yᵀ/τ.
    features f: ``(*batch, n, d)`` (network outputs) → E[y_{φ_i}] ``(*batch, n, d)``;
    ``class_probabilities(f)``: ``(*batch, n, num_classes)``.

    Args:
        d (int): the features' size, a positive int: f is ``(*batch, n, d)`` and the class
            embeddings Y are ``(num_classes, d)``, initialised at N(0, 1)/√d.
        num_classes (int): the number of classes, a positive int.
        temperature (float | torch.Tensor | str): τ of the logits: a finite number > 0, a
            tensor, or ``"learned"`` (τ = exp(log τ), a parameter initialised at 1).
            Default 1.0.
        device (torch.device | str | None): the device of the class embeddings.
        dtype (torch.dtype | None): the dtype of the class embeddings.
    """

    def __init__(self, d, num_classes, *, temperature=1.0, device=None, dtype=None):
        super().__init__()
        d, num_classes = check_size("Classification", "d", d), check_size(
            "Classification", "num_classes", num_classes)
        self.d, self.num_classes = d, num_classes
        self.class_embeddings = nn.Parameter(torch.randn(num_classes, d, device=device,
                                                         dtype=dtype) / math.sqrt(d))
        if temperature == "learned":
            self.log_temperature = nn.Parameter(torch.zeros((), device=device, dtype=dtype))
        else:
            check_temperature(temperature, "Classification")
            self.log_temperature, self._temperature = None, temperature

    @property
    def temperature(self):
        return self._temperature if self.log_temperature is None else self.log_temperature.exp()

    def model(self, features):
        self.check_inputs(features=features)
        self.check_finite_inputs(features=features)
        outputs = nodes("outputs", features, features=self.d)
        y = self.class_embeddings.expand(*features.shape[:-2], self.num_classes, self.d)
        classes = nodes("classes", y)
        phi = edges("class", outputs, classes, Uniform())
        potential(phi, DotProduct(temperature=self.temperature))
        return expect(phi, Identity())[..., 0, :, :]

    def class_probabilities(self, features):
        """p(φ_i = class | f): ``(*batch, n, num_classes)``."""
        return compile_model(self)(features, return_posterior=True)[1][..., 0, :, :]

    def example_inputs(self, n=3, batch=1):
        return (self._randn(batch, n, self.d),)


def classification(d, num_classes=4, **kwargs) -> Classification:
    """The classification-layer declaration; see ``Classification``."""
    return Classification(d, num_classes, **kwargs)


def _case():
    m = classification(7, 5, temperature=0.7, dtype=torch.float64)
    return m, (randn64(2, 3, 7),)


#: the catalogue's statement (structattn/models/_catalogue.py)
ENTRY = Entry(classification, Classification, case=_case,
              example=dict(d=8, num_classes=4),
              sizes=dict(d=1, num_classes=1))
