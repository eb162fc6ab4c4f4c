"""Predictive coding with attention
================================

Predictive coding with attention over incoming units or blocks (paper §4.4, appendix 7.2) against the
standard precision-weighted network, trained with the local learning rule on scikit-learn's
bundled 8 × 8 digits (no download): 64 pixels scaled to [0, 1], 10 classes one-hot, a fixed
split of 1,397 training and 400 test digits.

Every network is ``sa.models.predictive_coding(layer_sizes, …)`` with the same settings (the
defaults below: layers [64, 64, 10], tanh, precision k = 1, 20 inference steps of size 0.1
while training — the published attention-PCN's — and 20 and 200 at test; Adam, learning rate
1e-3, mini-batches of 32, 10 epochs, seeds 0 … 4):

- attention over blocks (``blocks=[1, K, 1]``, K = ``--blocks`` = 4): the hidden layer is K
  blocks of 64/K units, each predicted from the whole input; the output picks one hidden
  block, F_out = −log (1/K) Σ_j exp(−(k/2)‖y − W_j f(h_j) − b‖²) (the paper's "blocks of
  units competing"; the same number of weights as the standard network). Run twice: at the
  shared k = 1 and at k = ``--sharp-precision`` (5), where the posterior is sharper;
- attention over units (the paper's derivation as written): each unit picks one incoming
  unit, F = −Σ_i log (1/n) Σ_j exp(−(k/2)(z_i − w_ij f(z_j) − b_i)²);
- the standard network: F = Σ_l (k/2)‖z_l − W_l f(z_{l−1}) − b_l‖².

Training step per mini-batch: relax the hidden layer with the target clamped, without
gradients (``layer(x, y, return_trace=True)``), then one Adam step on the gradient of the mean
free energy at those fixed states (``layer.free_energy(x, y, latents=final)``: the local
rule). Test: ``layer(x)`` (the output layer inferred too, from the prediction under the prior:
the mean of the single-edge predictions for the attention networks) and the class is the
argmax of the returned top layer. The unit networks without a hidden layer ([64, 10]; nothing
to relax while training) are trained alongside as a control.

Shows (``gallery/output/predictive_coding/``):

- ``pc_learning_curves.png``: test accuracy (20 inference steps) and the training free energy
  (mean over an epoch's mini-batches of F at the relaxed states) per epoch, every seed;
- ``pc_test_inference.png``: the free energy (mean over test digits) and the test accuracy
  per inference step at test, 0 … 200 steps, every seed;
- ``pc_block_posterior.png``: the block networks' posterior of the output over the hidden
  blocks, per true class with the label clamped (which block explains which digits), and how
  sharp it is, label clamped and inferred;
- ``pc_attention_posterior.png``: the unit networks' posteriors over incoming units after
  test inference, for the first four test digits, as n·p − 1 (0: uniform): every output
  unit's over the hidden units ([64, 64, 10]) and, as 8 × 8 images, every output unit's over
  the pixels ([64, 10]).

Measured (``gallery/README.md``): attention over blocks matches the standard network (≈ 92%);
attention over units does not learn with a hidden layer (its hidden units collapse to one
state for every digit) and reaches ≈ 68% without one.

Printed: a markdown table (accuracy mean ± sd over seeds, free energies, the spread of the
hidden units over test digits, inference steps, time per inference step measured on the
400 test digits). Everything runs on one CPU thread (tiny tensors: a second thread only adds
synchronisation; restored on return).
``--quick``: 200 training and 100 test digits, a hidden layer of 16, 1 epoch, 1 seed, 5
training and 10 test steps, no recorded plans (the test suite).
``--recipe authors``: the authors' network infers with their schedule (``recipe="authors"``:
their sweep over the predictions, bottom-up, both ends of each stepping on its own term) in
place of the engine's; ``--authors-optimiser``: its weights by their optimiser (Adam,
learning rate 1e-4, weight decay 1, on the mini-batch sum of their F = F/T) in place of the
shared Adam. The other networks are unchanged by either.
Run: ``python gallery/plot_predictive_coding.py [--epochs E] [--seeds S] [--hidden H]
[--blocks K] [--precision K] [--sharp-precision K] [--lr LR] [--recipe library|authors]
[--authors-optimiser] [--out DIR] [--quick]``
"""
# mkdocs_gallery_thumbnail_path = "../gallery/results/pc_learning_curves.png"

from __future__ import annotations

import argparse
import datetime
import os
import time
import warnings
from typing import NamedTuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import Normalize  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import structattn as sa  # noqa: E402

CLASSES = 10
SPLIT = 1397  # training digits; the remaining 400 of 1,797 are the test set
NETWORKS = ("blocks", "standard", "units", "choice")  # ``Config.kind``: ``--networks``


class Config(NamedTuple):
    """One network: ``kind`` ∈ {"standard", "units", "blocks"} (attention over incoming units,
    or over blocks of units), its layer sizes and, for "blocks", the blocks per layer."""

    kind: str
    sizes: tuple
    blocks: tuple | None = None
    precision: float | None = None  # None: the shared --precision
    predictors: int | None = None  # "choice": K whole-layer predictors per layer
    norm: str = "euclidean"  # "choice": the error's norm
    temperature: float = 1.0  # "choice": T
    recipe: str = "library"  # "choice": the schedule of its inference steps
    authors_optimiser: bool = False  # "choice": the weights by the authors' Adam

    @property
    def name(self) -> str:
        if self.kind == "choice":
            return (f"choice of {self.predictors} predictors, {self.norm} error, "
                    f"T = {self.temperature:g}"
                    + ("" if self.recipe == "library" else f", {self.recipe}' recipe")
                    + (", their Adam (1e-4, weight decay 1)" if self.authors_optimiser else ""))
        name = {"standard": "standard", "units": "attention (units)",
                "blocks": f"attention (blocks {list(self.blocks or ())})"}[self.kind]
        return name if self.precision is None else f"{name}, k = {self.precision:g}"

    @property
    def colour(self) -> str:
        if self.kind == "choice":
            return "C4" if self.norm == "euclidean" else "C5"
        if self.precision is not None:
            return "C1"
        return {"standard": "C0", "units": "C3", "blocks": "C2"}[self.kind]

    @property
    def deep(self) -> bool:
        return len(self.sizes) > 2


# -- data -------------------------------------------------------------------------------------
def digits(train_size, test_size):
    """Pixels in [0, 1] ``(n, 64)`` float32 and labels ``(n,)``, split by a fixed permutation."""
    data = load_digits()
    X = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target)
    perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(0))
    train, test = perm[:SPLIT][:train_size], perm[SPLIT:][:test_size]
    return X[train], y[train], X[test], y[test]


def one_hot(y):
    return torch.nn.functional.one_hot(y, CLASSES).to(torch.float32)


# -- training and testing ---------------------------------------------------------------------
def build(cfg, args):
    if cfg.kind == "choice":  # the authors' network: generative, the label on top
        return sa.models.predictor_choice_coding(
            list(cfg.sizes), predictors=cfg.predictors, temperature=cfg.temperature,
            norm=cfg.norm, steps=args.steps, step_size=args.step_size, recipe=cfg.recipe)
    return sa.models.predictive_coding(
        list(cfg.sizes), attention=cfg.kind != "standard",
        blocks=list(cfg.blocks) if cfg.blocks else None,
        precision=args.precision if cfg.precision is None else cfg.precision,
        activation=args.activation, steps=args.steps, step_size=args.step_size)


def train_step(m, layer, opt, x, y, summed=False):
    """Relax the hidden layers with y clamped (no gradients), then one step on ∂F/∂θ at the
    relaxed states (``summed``: of the sum over the mini-batch of the authors' F = F/T, as
    their code steps, instead of the mean of F). Returns the mean free energy there and
    whether F rose in the relaxation for some digit (the library's ``DivergenceWarning``
    test, read from the trace: that warning watches ``update="gradient"`` only)."""
    rose = False
    if len(m.layer_sizes) > 2:
        with torch.no_grad():
            _, trace = layer(x, y, return_trace=True)
        final = {name: s[-1] for name, s in trace.states.items()}
        f0, f1 = trace.free_energy[0], trace.free_energy[-1]
        rose = bool((~torch.isfinite(f1) | (f1 > f0 + torch.finfo(f0.dtype).eps ** 0.5
                                            * (f0.abs() + 1))).any())
    else:  # no hidden layer: with y clamped nothing is latent
        final = {}
    F = layer.free_energy(x, y, latents=final)
    loss = F.sum() / float(m.temperature) if summed else F.mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(F.detach().mean()), rose


def accuracy(layer, X, y, steps):
    with torch.no_grad(), sa.iteration(steps=steps), warnings.catch_warnings():
        warnings.simplefilter("ignore", sa.DivergenceWarning)  # counted while training
        return float((layer(X).argmax(-1) == y).to(torch.float32).mean())


def test_trace(m, layer, X, y, steps):
    """Free energy ``(steps + 1,)`` (mean over digits) and accuracy per inference step, and the
    spread of the hidden units over digits after inference (mean over units of the sd)."""
    with torch.no_grad(), sa.iteration(steps=steps):
        _, trace = layer(X, return_trace=True)
    top = trace.states[f"layer{len(m.layer_sizes) - 1}"].flatten(-2)  # (steps + 1, B, 10)
    acc = (top.argmax(-1) == y).to(torch.float32).mean(-1)
    hidden = trace.states.get("layer1") if len(m.layer_sizes) > 2 else None
    spread = float(hidden[-1].flatten(-2).std(0).mean()) if hidden is not None else float("nan")
    return trace.free_energy.mean(-1), acc, spread, trace.free_energy[-1]


def clamped_free_energies(layer, X, steps):
    """F after ``steps`` inference steps with each one-hot label clamped: ``(B, classes)``."""
    Fs = []
    with torch.no_grad(), sa.iteration(steps=steps):
        for c in range(CLASSES):
            y = one_hot(torch.full((len(X),), c))
            if len(layer.declaration.layer_sizes) > 2:
                _, trace = layer(X, y, return_trace=True)
                Fs.append(trace.free_energy[-1])
            else:  # nothing latent: F at the clamped states
                Fs.append(layer.free_energy(X, y))
    return torch.stack(Fs, -1)


def time_per_step(layer, X, steps, repeats=3):
    """Seconds per inference step on X: (best time at ``steps`` − best at 0) / steps."""
    def best(T):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            with torch.no_grad(), sa.iteration(steps=T):
                layer(X)
            times.append(time.perf_counter() - start)
        return min(times)
    return (best(steps) - best(0)) / steps


def train(cfg, seed, data, args):
    """One network: per-epoch test accuracy (``args.steps`` steps; epoch 0 = untrained) and
    training free energy, then the test trace at ``args.test_steps``. ``rose``: the share of
    training relaxations whose F ended above its start (a ``DivergenceWarning``: with the
    Euclidean error a fixed step overshoots the cone's tip)."""
    Xtr, ytr, Xte, yte = data
    torch.manual_seed(seed)
    m = build(cfg, args)
    # --quick (the test suite) reads every call: each of its short-lived signatures would cost
    # a plan's recording (~1 s for an unrolled relaxation) to serve a handful of calls
    layer = sa.compile(m, replay=not args.quick)
    if cfg.authors_optimiser:  # theirs (main.py): Adam on the batch sum of their F
        opt = torch.optim.Adam(m.parameters(), lr=1e-4, weight_decay=1.0)
    else:
        opt = torch.optim.Adam(m.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(seed)
    acc, F = [accuracy(layer, Xte, yte, args.steps)], []
    start = time.perf_counter()
    relaxations, rose_in_trace = 0, 0
    with warnings.catch_warnings(record=True) as rose:
        warnings.simplefilter("always", sa.DivergenceWarning)
        for _ in range(args.epochs):
            order = torch.randperm(len(Xtr), generator=g)
            batches = order.split(args.batch)
            steps = [train_step(m, layer, opt, Xtr[b], one_hot(ytr[b]),
                                summed=cfg.authors_optimiser) for b in batches]
            relaxations += len(batches)
            rose_in_trace += sum(r for _, r in steps)
            F.append(float(np.mean([loss for loss, _ in steps])))
            acc.append(accuracy(layer, Xte, yte, args.steps))
    seconds = time.perf_counter() - start
    if cfg.recipe == "library":
        rose = sum(issubclass(w.category, sa.DivergenceWarning) for w in rose)
    else:  # a callable update: no warning; the same test on the recorded F
        rose = rose_in_trace
    rose = rose / max(relaxations, 1)
    F_test, acc_test, spread, F_digits = test_trace(m, layer, Xte, yte, args.test_steps)
    F_clamped = clamped_free_energies(layer, Xte, args.test_steps)
    # every seed's layer is kept for the pictures, but not its plans: a plan of a 200-step
    # relaxation is the unrolled graph, ~0.5 GB a layer here, and 40 layers' plans filled
    # 24 GB (a later call simply records again)
    layer.reset()
    return {"model": m, "layer": layer, "acc": acc, "F": F, "F_test": F_test,
            "acc_test": acc_test, "spread": spread, "train_seconds": seconds, "rose": rose,
            "F_clamped": F_clamped, "F_digits": F_digits,
            "acc_argmin": float((F_clamped.argmin(-1) == yte).float().mean())}


# -- pictures -------------------------------------------------------------------------------
def plot_learning(runs, args, path, title):
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.8))
    for cfg, seeds in runs.items():
        ls = "-" if cfg.deep else ":"
        label = f"{cfg.name} {list(cfg.sizes)}"
        for s, r in enumerate(seeds):
            kw = {"color": cfg.colour, "ls": ls, "lw": 1.2, "alpha": 0.8,
                  "label": label if s == 0 else None}
            axes[0].plot(range(len(r["acc"])), r["acc"], marker="o", ms=2.5, **kw)
            axes[1].plot(range(1, len(r["F"]) + 1), r["F"], marker="o", ms=2.5, **kw)
    axes[0].axhline(0.1, color="0.5", lw=0.8, ls="--")
    axes[0].annotate("chance", (0, 0.1), xytext=(2, 3), textcoords="offset points", fontsize=7)
    axes[0].set_ylim(0, 1)
    axes[0].set_xlabel("epoch (0: untrained)")
    axes[0].set_ylabel(f"test accuracy ({args.steps} inference steps)")
    axes[1].set_xlabel("epoch")
    axes[1].set_ylabel("training free energy\n(mean F at the relaxed states, y clamped)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.tick_params(labelsize=8)
    # one legend for both panels, below them: inside either it hid the curves
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", fontsize=7, frameon=False,
               ncol=3 if max(map(len, labels)) < 50 else 1,  # long labels: one per row
               title="one line per seed", title_fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.17, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_test_inference(runs, args, path, title):
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 4.1))
    for cfg, seeds in runs.items():
        ls = "-" if cfg.deep else ":"
        drop = max(abs(float(r["F_test"][0] - r["F_test"][-1])) for r in seeds)
        for s, r in enumerate(seeds):
            label = f"{cfg.name} {list(cfg.sizes)}"
            kw = {"color": cfg.colour, "ls": ls, "lw": 1.2, "alpha": 0.8}
            steps = np.arange(len(r["F_test"]))
            axes[0].plot(steps, r["F_test"].numpy().clip(1e-17), **kw,
                         label=f"{label}: |F_0 − F_{args.test_steps}| ≤ {drop:.1g}" if s == 0 else None)
            axes[1].plot(steps, r["acc_test"].numpy(), **kw, label=label if s == 0 else None)
    axes[0].set_ylabel("free energy F (mean over test digits)")
    axes[0].set_yscale("log")
    axes[0].set_ylim(1e-17, 1)
    axes[0].text(0.03, 0.2, "standard: the feed-forward guess has zero prediction error,\n"
                 "F = 0 up to rounding at every step", transform=axes[0].transAxes, fontsize=7,
                 color="C0")
    axes[1].set_ylabel("test accuracy (argmax of the top layer)")
    axes[1].set_ylim(0, 1)
    axes[1].axhline(0.1, color="0.5", lw=0.8, ls="--")
    for ax in axes:
        ax.set_xlabel("inference step at test (no target)")
        ax.axvline(args.steps, color="k", ls=":", lw=0.8)
        ax.legend(fontsize=7, title=f"one line per seed; vertical: {args.steps} steps",
                  title_fontsize=7, loc="center right")
        ax.tick_params(labelsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_posterior(runs, X, y, args, path, title, examples=4):
    """Per test digit: the deep attention network's posterior of every output unit over the
    hidden units, and the shallow one's posterior of every output unit over the pixels."""
    deep = runs[Config("units", (64, args.hidden, CLASSES))][0]["layer"]
    shallow = runs[Config("units", (64, CLASSES))][0]["layer"]
    x = X[:examples]
    with torch.no_grad(), sa.iteration(steps=args.test_steps):
        out_d, post_d = deep(x, return_posterior=True)
        out_s, post_s = shallow(x, return_posterior=True)
    p_d = post_d["predict2"][:, 0].numpy()  # (B, 10, n1): output unit i over hidden units j
    if isinstance(post_s, dict):  # one edge family: the posterior itself, not a dict
        post_s = post_s["predict1"]
    p_s = post_s[:, 0].numpy()  # (B, 10, 64): output unit i over pixels j
    n1 = p_d.shape[-1]
    fig = plt.figure(figsize=(15, 2.4 * examples + 0.8))
    grid = fig.add_gridspec(examples, 3, width_ratios=[1, 3.2, 10.5], wspace=0.15, hspace=0.6)
    # white = uniform (n·p = 1), red above, blue below; each network's own symmetric range
    dev_d, dev_s = p_d * n1 - 1, p_s * 64 - 1  # n·p − 1: 0 = uniform
    norms = [Normalize(-d, d) for d in (max(float(abs(v).max()), 1e-12) for v in (dev_d, dev_s))]
    deep_axes, shallow_axes = [], []
    for r in range(examples):
        ax = fig.add_subplot(grid[r, 0])
        ax.imshow(x[r].reshape(8, 8).numpy(), cmap="gray_r", vmin=0, vmax=1)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_ylabel(f"digit {int(y[r])}", fontsize=8)
        ax = fig.add_subplot(grid[r, 1])
        pred = int(out_d[r].argmax())
        im_d = ax.imshow(dev_d[r], cmap="RdBu_r", aspect="auto", norm=norms[0])
        deep_axes.append(ax)
        ax.set_yticks(range(CLASSES))
        ax.tick_params(labelsize=6)
        ax.set_ylabel("output unit i", fontsize=7)
        ax.set_title(f"[64, {n1}, 10]: {n1}·p(φ_i = hidden j) − 1\npredicted {pred}", fontsize=8,
                     color="k" if pred == int(y[r]) else "C3")
        inner = grid[r, 2].subgridspec(1, CLASSES, wspace=0.08)
        pred = int(out_s[r].argmax())
        for i in range(CLASSES):
            ax = fig.add_subplot(inner[0, i])
            im_s = ax.imshow(dev_s[r, i].reshape(8, 8), cmap="RdBu_r", norm=norms[1])
            shallow_axes.append(ax)
            ax.set_xticks([])
            ax.set_yticks([])
            hit = i == pred
            ax.set_title(f"unit {i}" + (" (argmax)" if hit else ""), fontsize=7,
                         color=("k" if pred == int(y[r]) else "C3") if hit else "0.3")
            if hit:
                for spine in ax.spines.values():
                    spine.set_edgecolor("k" if pred == int(y[r]) else "C3")
                    spine.set_linewidth(2)
        if r == 0:
            ax.text(1.1, 1.6, "[64, 10]: 64·p(φ_i = pixel) − 1 of each output unit i (8 × 8)",
                    transform=ax.transAxes, fontsize=8, ha="right")
    for im, axes, label in ((im_d, deep_axes, f"{n1}·p − 1"), (im_s, shallow_axes, "64·p − 1")):
        bar = fig.colorbar(im, ax=axes, fraction=0.04 if axes is deep_axes else 0.012, pad=0.02)
        bar.set_label(f"{label} (0 = uniform)", fontsize=7)
        bar.ax.tick_params(labelsize=6)
        bar.formatter.set_powerlimits((-2, 2))
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def per_class_mean(p, y):
    """The mean of ``p`` ``(B, K)`` over the digits of each true class: ``(classes, K)``."""
    return torch.stack([p[y == c].mean(0) for c in range(CLASSES)]).numpy()


def block_posterior(layer, X, steps, y=None):
    """The output node's posterior over the hidden blocks after inference (the output inferred,
    or clamped to the one-hot ``y``): ``(B, K)``."""
    with torch.no_grad(), sa.iteration(steps=steps):
        _, post = layer(X, *([] if y is None else [one_hot(y)]), return_posterior=True)
    return post["predict2"][:, 0, 0]  # (B, heads=1, one output node, K blocks) → (B, K)


def plot_block_posterior(runs, X, y, args, path, title, seeds_shown=3):
    """Each block network (one row per precision): the mean posterior of the output node over
    the hidden blocks per true class, with the label clamped (which block explains which
    digits) for the first seeds, and how sharp it is (max_j p per test digit, every seed;
    label clamped, solid, and inferred, dashed)."""
    cfgs = [c for c in runs if c.kind == "blocks"]
    shown = min(seeds_shown, len(runs[cfgs[0]]))
    fig, axes = plt.subplots(len(cfgs), shown + 1, figsize=(2.3 * shown + 4.2, 3.3 * len(cfgs)),
                             squeeze=False, constrained_layout=True,
                             gridspec_kw={"width_ratios": [1] * shown + [1.6]})
    for row, cfg in zip(axes, cfgs, strict=True):
        K = cfg.blocks[1]
        k = args.precision if cfg.precision is None else cfg.precision
        for s, r in enumerate(runs[cfg]):
            p = block_posterior(r["layer"], X, args.test_steps, y)
            free = block_posterior(r["layer"], X, args.test_steps)
            if s < shown:
                ax = row[s]
                per_class = per_class_mean(p, y)
                im = ax.imshow(per_class, cmap="Greens", vmin=0, vmax=1, aspect="auto")
                ax.set_xticks(range(K))
                ax.set_yticks(range(CLASSES))
                ax.tick_params(labelsize=7)
                ax.set_xlabel("hidden block j", fontsize=8)
                ax.set_ylabel(f"k = {k:g}\ntrue class of the test digit" if s == 0 else "",
                              fontsize=8)
                ax.set_title(f"seed {s}: accuracy {float(r['acc_test'][-1]):.1%}", fontsize=8)
            bins = np.linspace(1 / K, 1, 31)
            row[-1].hist(p.max(-1).values.numpy(), bins=bins, histtype="step", lw=1.2,
                         color=f"C{s}", label=f"seed {s}")
            row[-1].hist(free.max(-1).values.numpy(), bins=bins, histtype="step", lw=1.0,
                         ls="--", color=f"C{s}")
        fig.colorbar(im, ax=list(row[:-1]), fraction=0.04).set_label(
            "mean p(output picks block j), label clamped", fontsize=7)
        row[-1].set_xlabel("max_j p(φ = j) per test digit (1/K: uniform)\n"
                           "solid: label clamped; dashed: output inferred", fontsize=8)
        row[-1].set_ylabel("test digits", fontsize=8)
        row[-1].axvline(1 / K, color="0.5", ls="--", lw=0.8)
        row[-1].legend(fontsize=6)
        row[-1].tick_params(labelsize=7)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_choice(runs, X, y, args, path, title):
    """The authors' networks (one row each): with the label clamped, the mean posterior of the
    hidden layer and of the image over the K predictors per true class (seed 0), and per test
    digit the free energy of the label inferred by gradient descent minus the least F over the
    ten one-hot labels clamped (every seed): below 0, a label state that is no class explains
    the digit better than any class does."""
    cfgs = [c for c in runs if c.kind == "choice"]
    fig, axes = plt.subplots(len(cfgs), 3, figsize=(13, 3.4 * len(cfgs)), squeeze=False,
                             constrained_layout=True, gridspec_kw={"width_ratios": [1, 1, 1.6]})
    for row, cfg in zip(axes, cfgs, strict=True):
        seeds = runs[cfg]
        with torch.no_grad(), sa.iteration(steps=args.test_steps):
            _, post = seeds[0]["layer"](X, one_hot(y), return_posterior=True)
        for ax, fam, what in ((row[0], "predict1", "hidden layer"), (row[1], "predict0", "image")):
            p = post[fam][:, 0, 0]  # (B, K)
            per_class = per_class_mean(p, y)
            im = ax.imshow(per_class, cmap="Purples", vmin=0, vmax=1, aspect="auto")
            ax.set_xticks(range(cfg.predictors))
            ax.set_yticks(range(CLASSES))
            ax.tick_params(labelsize=7)
            ax.set_xlabel(f"predictor k of the {what}", fontsize=8)
            ax.set_ylabel(f"{cfg.norm}, T = {cfg.temperature:g}\ntrue class", fontsize=8)
            ax.set_title("p(φ = k), label clamped (seed 0)", fontsize=8)
        fig.colorbar(im, ax=list(row[:2]), fraction=0.04).set_label("mean posterior", fontsize=7)
        gaps = [(r["F_digits"] - r["F_clamped"].min(-1).values).numpy() for r in seeds]
        lo, hi = min(g.min() for g in gaps), max(g.max() for g in gaps)
        bins = np.linspace(lo, hi, 41)
        for k, g in enumerate(gaps):
            row[2].hist(g, bins=bins, histtype="step", color=f"C{k}", lw=1.1,
                        label=f"seed {k}: {np.mean(g < 0):.0%} below 0; accuracy "
                              f"{float(seeds[k]['acc_test'][-1]):.1%} inferred, "
                              f"{seeds[k]['acc_argmin']:.1%} argmin F")
        row[2].axvline(0, color="k", lw=0.8, ls=":")
        row[2].set_xlabel(f"F(label inferred, {args.test_steps} steps) − min over the ten "
                          f"one-hot labels of F (label clamped)", fontsize=8)
        row[2].set_ylabel("test digits", fontsize=8)
        row[2].legend(fontsize=6)
        row[2].tick_params(labelsize=7)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the table ----------------------------------------------------------------------------------
def mean_sd(values, fmt="{:.1%}"):
    v = np.asarray(values, dtype=float)
    sd = v.std(ddof=1) if len(v) > 1 else float("nan")
    return f"{fmt.format(v.mean())} ± {fmt.format(sd)}" if len(v) > 1 else fmt.format(v.mean())


def table(runs, timings, args):
    rows = [f"| model | layers | test accuracy, {args.steps} steps | test accuracy, "
            f"{args.test_steps} steps | test accuracy, argmin over labels of F | training F, "
            f"last epoch | test F, step 0 → {args.test_steps} | hidden spread (sd over digits) "
            f"| training relaxations where F rose | ms per inference step (batch "
            f"{args.test_size}) | time per epoch (training + test at {args.steps} steps) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for cfg, seeds in runs.items():
        rows.append(
            f"| {cfg.name} | {list(cfg.sizes)} | {mean_sd([r['acc'][-1] for r in seeds])} | "
            f"{mean_sd([float(r['acc_test'][-1]) for r in seeds])} | "
            f"{mean_sd([r['acc_argmin'] for r in seeds])} | "
            f"{mean_sd([r['F'][-1] for r in seeds], '{:.3g}')} | "
            f"{np.mean([float(r['F_test'][0]) for r in seeds]):.3g} → "
            f"{np.mean([float(r['F_test'][-1]) for r in seeds]):.3g} | "
            + ("—" if not cfg.deep else mean_sd([r["spread"] for r in seeds], "{:.2g}"))
            + f" | {np.mean([r['rose'] for r in seeds]):.0%} | {timings[cfg] * 1e3:.2f} | "
            f"{np.mean([r['train_seconds'] for r in seeds]) / max(args.epochs, 1):.1f} s |")
    return "\n".join(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--seeds", type=int, default=5, help="seeds 0 … S − 1")
    p.add_argument("--hidden", type=int, default=64, help="hidden units (layers [64, H, 10])")
    p.add_argument("--blocks", type=int, default=4,
                   help="hidden blocks of the block attention network (blocks [1, K, 1])")
    p.add_argument("--precision", type=float, default=1.0, help="precision k (every network)")
    p.add_argument("--sharp-precision", type=float, default=5.0,
                   help="the block network's precision in its second run (sharper posteriors)")
    p.add_argument("--predictors", type=int, default=4,
                   help="K, the predictors per layer of the authors' network (choice)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="T of the authors' network with the Euclidean error (theirs: 1)")
    p.add_argument("--squared-temperature", type=float, default=0.1,
                   help="T of the authors' network with the squared error")
    p.add_argument("--recipe", default="library", choices=["library", "authors"],
                   help="the authors' network's inference schedule: the engine's (library) or "
                        "the authors' sweep (authors)")
    p.add_argument("--authors-optimiser", action="store_true",
                   help="train the authors' network with their optimiser: Adam, lr 1e-4, "
                        "weight decay 1, on the mini-batch sum of their F")
    p.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=NETWORKS,
                   help="train only these networks (default: all); the pictures that need a "
                        "network left out are not drawn")
    p.add_argument("--activation", default="tanh", choices=["tanh", "none"])
    p.add_argument("--steps", type=int, default=20, help="inference steps while training")
    p.add_argument("--step-size", type=float, default=0.1, help="inference step size")
    p.add_argument("--test-steps", type=int, default=200, help="inference steps at test")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--train-size", type=int, default=SPLIT)
    p.add_argument("--test-size", type=int, default=400)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "output",
                                                 "predictive_coding"))
    p.add_argument("--quick", action="store_true", help="tiny and fast (test suite)")
    args = p.parse_args(argv)
    if args.quick:
        args.train_size, args.test_size, args.hidden, args.epochs, args.seeds = 200, 100, 16, 1, 1
        args.blocks = 4
        args.steps, args.test_steps = 5, 10
    args.activation = None if args.activation == "none" else args.activation
    os.makedirs(args.out, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():  # F rising in a relaxation: counted while training
            warnings.simplefilter("ignore", sa.DivergenceWarning)
            return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args):
    start = time.perf_counter()
    data = digits(args.train_size, args.test_size)
    print(f"digits: {len(data[0])} training, {len(data[2])} test; {args.epochs} epochs, seeds 0 … "
          f"{args.seeds - 1}; precision {args.precision}, {args.activation or 'identity'}, "
          f"{args.steps} training / {args.test_steps} test inference steps of "
          f"{args.step_size}; Adam lr {args.lr}, batch {args.batch}; the authors' network: "
          f"{args.recipe} recipe"
          + (", their Adam (lr 1e-4, weight decay 1)" if args.authors_optimiser else ""))
    deep, shallow = (64, args.hidden, CLASSES), (64, CLASSES)
    configs = [Config("blocks", deep, (1, args.blocks, 1)),
               Config("blocks", deep, (1, args.blocks, 1), args.sharp_precision),
               Config("standard", deep),
               Config("units", deep), Config("units", shallow), Config("standard", shallow),
               Config("choice", deep, predictors=args.predictors, temperature=args.temperature,
                      recipe=args.recipe, authors_optimiser=args.authors_optimiser),
               Config("choice", deep, predictors=args.predictors, norm="squared",
                      temperature=args.squared_temperature, recipe=args.recipe,
                      authors_optimiser=args.authors_optimiser)]
    configs = [cfg for cfg in configs if cfg.kind in args.networks]
    runs, timings = {}, {}
    for cfg in configs:
        runs[cfg] = seeds = []
        for seed in range(args.seeds):
            r = train(cfg, seed, data, args)
            seeds.append(r)
            print(f"  {cfg.name:26} {str(list(cfg.sizes)):12} seed {seed}: test accuracy per epoch "
                  + " ".join(f"{a:.3f}" for a in r["acc"])
                  + f"; {args.test_steps} steps: {float(r['acc_test'][-1]):.3f}, argmin F "
                  f"{r['acc_argmin']:.3f}, F rose in {r['rose']:.0%} "
                  f"({r['train_seconds']:.1f} s)", flush=True)
        timings[cfg] = time_per_step(seeds[0]["layer"], data[2], args.test_steps,
                                     repeats=1 if args.quick else 3)

    print()
    print(table(runs, timings, args))
    print(f"\n{datetime.date.today()}, torch {torch.__version__}, 1 thread")

    written = []
    setting = (f"digits, {len(data[0])} train / {len(data[2])} test; {args.epochs} epochs, "
               f"{args.seeds} seeds; k = {args.precision}, {args.activation or 'identity'}, "
               f"{args.steps} inference steps of {args.step_size}; Adam lr {args.lr}")
    names = {cfg.kind for cfg in runs}
    if "choice" in names and (args.recipe != "library" or args.authors_optimiser):
        setting += (f"\nthe authors' network: {args.recipe} recipe"
                    + (", their Adam (lr 1e-4, weight decay 1)" if args.authors_optimiser
                       else ""))
    pictures = [  # (file, the networks it needs, how it is drawn)
        ("pc_learning_curves.png", set(), lambda path: plot_learning(
            runs, args, path, f"predictive coding: attention vs standard "
            f"(solid: one hidden layer, dotted: none)\n{setting}")),
        ("pc_test_inference.png", set(), lambda path: plot_test_inference(
            runs, args, path, f"test inference (no target), after training\n{setting}")),
        ("pc_attention_posterior.png", {"units"}, lambda path: plot_posterior(
            runs, data[2], data[3], args, path,
            f"attention networks (seed 0): posterior over incoming units after "
            f"{args.test_steps} test inference steps, for the first test digits",
            examples=2 if args.quick else 4)),
        ("pc_block_posterior.png", {"blocks"}, lambda path: plot_block_posterior(
            runs, data[2], data[3], args, path,
            f"block attention networks {list(deep)}, blocks [1, {args.blocks}, 1]: "
            f"the output's posterior over the hidden blocks\nafter "
            f"{args.test_steps} inference steps on the test digits")),
        ("pc_choice.png", {"choice"}, lambda path: plot_choice(
            runs, data[2], data[3], args, path,
            f"the authors' network {list(deep)}: a choice of {args.predictors} whole-layer "
            f"predictors tanh(W_k z) per layer, generative (the label on top)")),
    ]
    for name, needs, draw in pictures:
        if needs <= names:
            path = os.path.join(args.out, name)
            draw(path)
            written.append(path)
    print(f"({time.perf_counter() - start:.1f} s)\nwrote:\n  " + "\n  ".join(written))
    return written


if __name__ == "__main__":
    main()
