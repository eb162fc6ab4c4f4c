"""Predictive coding with a choice among whole-layer predictors: the authors' own network."""

from __future__ import annotations

import math

import torch
from torch import nn

import structattn as sa
from structattn.checks import check_layer_sizes, check_size
from structattn.compiling.lowering import operator_for

from ._catalogue import Entry, randn64

NORMS = {"euclidean": 1, "squared": 2}
RECIPES = ("library", "authors")


class PredictorChoiceCoding(sa.Declaration):
    r"""A generative predictive-coding network whose layers each choose one of $K$ predictors of
    the layer below (the authors' code, not the paper's derivation):

    $$
    φ_l ∼ \mathrm{Uniform}\{1..K\}, \quad ψ_{lk} = −T‖z_l − \tanh(W_{lk} z_{l+1})‖₂, \quad
    F = \sum_l −\log \tfrac{1}{K} \sum_k \exp ψ_{lk}
    $$

    (``norm="euclidean"``; or $−\tfrac{T}{2}‖\cdot‖²$, ``"squared"``) — $T$ times the authors'
    $F_l = −\tfrac{1}{T} \mathrm{logsumexp}_k(−T‖z_l − \tanh(W_k z_{l−1})‖)$, plus a constant, so a
    gradient step of ``step_size`` $dt$ on theirs is one of $dt/T$ on this one.

    Layers are listed bottom-up like ``predictive_coding``'s, ``layer_sizes = [n_0, …, n_L]``:
    layer 0 is the data x (observed), layer L the label y (observed when given: training;
    latent otherwise: inferred, from ``label_init`` in every unit, default 1/n_L). Predictions
    run top-down: the K predictions of layer l are a deterministic node set of layer l + 1
    (``structattn.deterministic``, with its pullback in closed form, so a plan records it), and
    layer l's one node picks one of them. The hidden layers start at the mean prediction from
    above (with ``label_init=0`` every prediction is tanh(0) = 0: the hidden layers start at
    the tip of every cone, where the Euclidean error's subgradient is 0).
    Inference: ``steps`` gradient steps on F (flat priors; dt = ``step_size`` on the authors'
    scale); learning: the gradient of F with respect to W at the relaxed states.

    Two schedules of those steps (``recipe``), the same F and dt:

    - ``"library"``: the engine's block coordinate descent, top-down: the label (when
      latent), then each hidden layer from the top, each a step on the whole ∂F/∂z_l with the
      others at their latest states;
    - ``"authors"``: the authors' loop (AttentionPCN, ``pcn.py``, ``PCN.infer``): one sweep
      over the predictions, from the image's up to the label's; at prediction l both of its
      ends take a step on that term alone, F_l = −log (1/K) Σ_k exp ψ_lk, both gradients
      taken at the same point: z ← z − (dt/T) ∂F_l/∂z for z = z_l and z_{l+1} (dt on the
      authors' F_l; observed ends stay). A hidden layer moves twice per sweep: as the
      predictor of the layer below, then as the layer its own predictions explain. Plain
      gradient steps, as theirs (their Adam, learning rate 1e-4 and weight decay 1, is the
      weights' optimiser, outside the model). The starting states are this model's in both
      recipes (the authors' start the label and hidden layers at N(0, 0.05²) noise at test).

    x: ``(*batch, n_0)``, y: ``(*batch, n_L)`` (optional) → the top layer ``(*batch, n_L)``.
    Parameters ``weights[l]``: ``(K, n_l, n_{l+1})``, N(0, 1/n_{l+1}).

    ::

        layer l+1        z_{l+1}
                      /    |    \          K predictions tanh(W_lk z_{l+1}) (deterministic)
        predictions   g_1  g_2 … g_K
                      \    |    /          φ_l ~ Uniform(K): one predictor
        layer l          z_l              ψ = −T‖z_l − g_φ‖

    Args:
        layer_sizes (Sequence[int]): ``[n_0, …, n_L]``, a list or tuple of ≥ 2 positive ints,
            bottom-up: the data's width first, the label's last.
        predictors (int): K, the predictors of each layer, a positive int. Default 4.
        temperature (float | torch.Tensor): T, the error's weight in ψ (the authors'
            temperature), a finite number > 0. Default 1.0.
        norm (str): the error: ``"euclidean"`` (default: ψ = −T‖·‖₂) or ``"squared"``
            (ψ = −(T/2)‖·‖²).
        label_init (float | None): the state every unit of the top layer starts at when no
            label is given, a finite number; None (default): 1/n_L.
        steps (int): gradient steps of inference on F, an int ≥ 0 (0: the latent layers stay
            at their starting states). Default 20.
        step_size (float): dt on the authors' scale (a step of dt/T on F), a finite
            number > 0. Default 0.1.
        grad (str): ``"unroll"`` (default: back-propagate through every step) or ``"last"``
            (iterate without gradients, then one differentiable step).
        recipe (str): the schedule of the inference steps: ``"library"`` (default: the
            engine's, the label then the hidden layers top-down, each on the whole of F) or
            ``"authors"`` (the authors' sweep over the predictions, bottom-up, both ends of
            each on its own term; see above).
        device (torch.device | str | None): where the weights are made; None: PyTorch's
            default.
        dtype (torch.dtype | None): the weights' dtype; None: PyTorch's default.
    """

    def __init__(self, layer_sizes, *, predictors=4, temperature=1.0, norm="euclidean",
                 label_init=None, steps=20, step_size=0.1, grad="unroll", recipe="library",
                 device=None, dtype=None):
        super().__init__()
        sizes = check_layer_sizes("PredictorChoiceCoding", layer_sizes, "data first, label last")
        K = check_size("PredictorChoiceCoding", "predictors", predictors)
        steps = check_size("PredictorChoiceCoding", "steps", steps, 0)
        if norm not in NORMS:
            raise ValueError(f"PredictorChoiceCoding: norm must be one of {list(NORMS)}; got "
                             f"{norm!r}")
        T = sa.potentials.temperature.check_temperature(temperature,
                                                        "PredictorChoiceCoding (temperature)")
        if label_init is not None and not (isinstance(label_init, (int, float))
                                           and math.isfinite(label_init)):
            raise ValueError(f"PredictorChoiceCoding: label_init must be a finite number or "
                             f"None (1/n_L); got {label_init!r}")
        if not isinstance(recipe, str) or recipe not in RECIPES:
            raise ValueError(f"PredictorChoiceCoding: recipe must be one of {list(RECIPES)}; "
                             f"got {recipe!r}")
        sa.IterationOptions(steps=steps, update="gradient", step_size=step_size, grad=grad)
        kw = {"device": device, "dtype": dtype}
        self.layer_sizes, self.predictors, self.temperature, self.norm = sizes, K, T, norm
        self.steps, self.step_size, self.grad, self.recipe = steps, step_size, grad, recipe
        self.label_init = 1.0 / sizes[-1] if label_init is None else float(label_init)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(K, sizes[l], sizes[l + 1], **kw) / math.sqrt(sizes[l + 1]))
            for l in range(len(sizes) - 1))

    def predictions(self, l: int, above: torch.Tensor) -> torch.Tensor:
        """Layer l's K predictions tanh(W_lk z_{l+1}) from layer l + 1's node states
        ``(*batch, 1, n_{l+1})``: ``(*batch, K, n_l)``."""
        W = self.weights[l]  # (K, n_l, n_{l+1}): one matrix product for the K predictors
        return torch.tanh(above @ W.flatten(0, 1).T).unflatten(-1, W.shape[:2])[..., 0, :, :]

    def pullback(self, l: int, u: torch.Tensor, g: torch.Tensor, above: torch.Tensor):
        """Σ_k ⟨u_k, ∂g_k/∂z⟩ = Σ_k W_lkᵀ (u_k ⊙ (1 − g_k²)) for g_k = tanh(W_lk z): ``(*batch,
        1, n_{l+1})`` from u, g ``(*batch, K, n_l)`` (the engine's gradient through the
        predictions, in closed form)."""
        W = self.weights[l]
        return (u * (1 - g * g)).flatten(-2).unsqueeze(-2) @ W.flatten(0, 1)

    def model(self, x, y=None):
        L = len(self.layer_sizes) - 1
        self.check_inputs(x=x, y=y)
        self.check_finite_inputs(x=x, y=y)
        self._check(x, y)
        options = {"scale": None, "update": "gradient", "steps": self.steps,
                   "step_size": self.step_size / float(self.temperature), "grad": self.grad}
        if self.recipe == "authors":  # one sweep per step, its states handed out per latent
            sweep = AuthorsSweep([f"predict{l}" for l in range(L)], options["step_size"])
            options["update"] = sweep
        if y is not None:
            top = sa.nodes(f"layer{L}", y.unsqueeze(-2))
            latents = []
        else:
            top = sa.latent(f"layer{L}", x.new_full((*x.shape[:-1], 1, self.layer_sizes[L]),
                                                    self.label_init), **options)
            latents = [top]
        potential = sa.potentials.Distance(precision=self.temperature, power=NORMS[self.norm])
        above = top
        for l in range(L - 1, -1, -1):
            g = sa.deterministic(f"predictions{l}", lambda z, l=l: self.predictions(l, z), above,
                                 pullback=lambda u, g, z, l=l: self.pullback(l, u, g, z))
            if l == 0:
                layer = sa.nodes("layer0", x.unsqueeze(-2))
            else:  # from the mean prediction under the prior
                layer = sa.latent(f"layer{l}", g.states.mean(-2, keepdim=True), **options)
                latents.append(layer)
            sa.potential(sa.edges(f"predict{l}", layer, g, sa.priors.Uniform()), potential)
            above = layer
        if latents:
            sa.infer(*latents)
        return top.states.flatten(-2)

    def _check(self, x, y):
        n0, nL = self.layer_sizes[0], self.layer_sizes[-1]
        if x.dim() < 1 or x.shape[-1] != n0:
            raise ValueError(f"PredictorChoiceCoding: x must have shape (*batch, {n0}); got "
                             f"{tuple(x.shape)}")
        if y is not None and y.shape != (*x.shape[:-1], nL):
            raise ValueError(f"PredictorChoiceCoding: y must have shape {(*x.shape[:-1], nL)} "
                             f"(x's batch, {nL} label units); got {tuple(y.shape)}")

    def example_inputs(self, n=None, batch=1):
        return (self._randn(batch, self.layer_sizes[0]),)


class AuthorsSweep:
    """The authors' schedule as an update rule ``update(state, step)`` shared by every latent
    layer: at each engine step, the update of the first latent that uses it runs one whole
    sweep over the edge families ``families`` (bottom-up) from the states at the start of the
    step, and hands that latent its new state; the later latents' updates return theirs.

    At family ``predict{l}`` (children: layer l; parents: its K predictions of layer l + 1)
    the gradients of F_l = −log_partition with respect to both ends are taken at the current
    states, then each latent end steps by ``step_size`` (dt/T). The prediction's end is
    reached through its pullback.

    Args:
        families (list[str]): the names of the edge families, bottom-up (``predict0`` first).
        step_size (float): the step on this model's F, dt/T.
    """

    def __init__(self, families, step_size):
        self.families, self.step_size = families, step_size
        self.pending = {}

    def __call__(self, state, step):
        engine = step.engine
        first = next(z for z in engine.latents if z.options.update is self)
        if step.latent is first:
            self.pending = self.sweep(engine)
        return self.pending.pop(step.latent.name)

    def sweep(self, engine) -> dict:
        latents = {id(z): z for z in engine.latents}
        start = {i: z.states for i, z in latents.items()}
        try:
            for name in self.families:
                fam = engine.families[name]
                layer, predictions = fam.children, fam.parents
                (above,) = predictions.sources
                op = operator_for(fam, engine.caches.setdefault(name, {}))
                terms = [(layer, "children"), (above, "parents")]
                moves = [(z, self.term_gradient(fam, op, side))
                         for z, side in terms if id(z) in latents]
                for z, g in moves:
                    z.states = z.states - self.step_size * g
            return {z.name: z.states for z in latents.values()}
        finally:
            for i, z in latents.items():
                z.states = start[i]

    @staticmethod
    def term_gradient(fam, op, side) -> torch.Tensor:
        """∂F_l/∂z = −E[∂ψ/∂z] for one end of family ``fam`` (the parents' side pulled back
        through the predictions to the layer above)."""
        us = [psi.expected_gradient(side, op) for psi in fam.potentials]
        u = sum(us[1:], us[0])
        return -(u if side == "children" else fam.parents.pull_back(u)[0])


def predictor_choice_coding(layer_sizes, **kwargs) -> PredictorChoiceCoding:
    """The authors' predictive-coding network: each layer picks one of K whole-layer predictors
    tanh(W_k z) of the layer above, with a Euclidean (or squared) error; generative, the label
    on top; see ``PredictorChoiceCoding``."""
    return PredictorChoiceCoding(layer_sizes, **kwargs)


def _case():
    m = predictor_choice_coding([5, 4, 3], predictors=3, temperature=1.5, steps=3,
                                step_size=0.05, dtype=torch.float64)
    return m, (randn64(2, 5),)


#: the catalogue's statement (structattn/models/_catalogue.py)
ENTRY = Entry(predictor_choice_coding, PredictorChoiceCoding, case=_case,
              example=dict(layer_sizes=[6, 4, 3], predictors=3, steps=10),
              sizes=dict(layer_sizes=1, predictors=1, steps=0))
