"""Structure in plate notation and in motion
=========================================

Every catalogue model's structure, in one sheet: its declaration in plate notation
(``sa.model_graph``, the iteration unrolled where it iterates) beside the adjacency it infers
on example inputs (``sa.render``: one panel per family and head, edge width = p(φ_i = j | x),
MAP edges bold), plus a sheet of structure that moves: expanding attention's windows per
mean-field iteration, slot attention's assignments per iteration, multihop's hop paths, and
a long sequence's attention as statistics.

Writes (``gallery/output/structures/``): ``<model>_declared.svg/png``,
``<model>_inferred.svg/png`` for each model, ``structures_sheet.png`` (all of them) and
``structures_dynamics.png``, ``long_sequence_expanding.png`` (2,000 tokens, plotted by
``sa.plot_attention``). Reads ``structattn.models.REGISTRY`` and ``EXAMPLES``, so a new
model appears without editing this file.
Run: ``python gallery/plot_structures.py [--out DIR] [--quick]`` (``--quick``: four models).
"""
# mkdocs_gallery_thumbnail_path = "../gallery/results/structures_dynamics.png"

from __future__ import annotations

import argparse
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import structattn as sa  # noqa: E402


def build(name):
    torch.manual_seed(0)
    model = sa.models.REGISTRY[name](**sa.models.EXAMPLES[name])
    if hasattr(model, "position_logits"):  # a non-trivial learned prior
        with torch.no_grad():
            model.position_logits.normal_()
    inputs = tuple(x * 3 if x.is_floating_point() else x for x in model.example_inputs(n=6))
    return model, inputs


def draw_model(name, out):
    model, inputs = build(name)
    written = []
    for kind, dot in (("declared", sa.model_graph(model, *inputs, unrolled=True)),
                      ("inferred", sa.render(model, *inputs, labels=True))):
        for ext in ("svg", "png"):
            written.append(sa.save(dot, os.path.join(out, f"{name}_{kind}.{ext}")))
    return written


def save(fig, path, dpi):
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def sheet(names, out):
    fig, axes = plt.subplots(len(names), 2, figsize=(16, 4.2 * len(names)), squeeze=False)
    for r, name in enumerate(names):
        for c, kind in enumerate(("declared", "inferred")):
            ax = axes[r, c]
            ax.imshow(mpimg.imread(os.path.join(out, f"{name}_{kind}.png")))
            ax.set_title(f"{name}: {'declaration (plates)' if c == 0 else 'inferred adjacency'}",
                         fontsize=11)
            ax.axis("off")
    return save(fig, os.path.join(out, "structures_sheet.png"), dpi=80)


def planted_expanding(n, d, seed=1):
    """Expanding attention on a sequence whose token i copies the key of token i − 2 or i − 7
    (the prior's first window, 7, just reaches 7): the model and its input ``(1, n, d)``."""
    torch.manual_seed(seed)
    keys = torch.nn.functional.normalize(torch.randn(n, d // 2), dim=-1)
    back = torch.where(torch.rand(n) < 0.5, 2, 7)
    target = (torch.arange(n) - back).clamp(min=0)
    x = torch.cat([keys, keys[target]], -1)[None]
    m = sa.models.expanding_attention(d, a=3.0, b=3.0, temperature=1.0)
    with torch.no_grad():
        m.W_q.zero_()[: d // 2, d // 2:] = torch.eye(d // 2) * 10
        m.W_k.zero_()[: d // 2, : d // 2] = torch.eye(d // 2)
    return m, x


def long_sequence(out, quick):
    """A long sequence plotted, not drawn as a graph (``sa.plot_attention``): the planted
    copy task on 2,000 tokens — MAP parents 2 and 7 back (two lines under the diagonal), the
    mass per distance (peaks at 2 and 7), each token's mean-field window."""
    m, x = planted_expanding(400 if quick else 2000, 32)
    path = os.path.join(out, "long_sequence_expanding.png")
    sa.plot_attention(m, x, filename=path)
    return path


def dynamics(out, quick):
    """Windows per mean-field iteration, slot assignments per iteration, multihop paths."""
    fig = plt.figure(figsize=(15, 8.5))
    grid = fig.add_gridspec(2, 4)
    # expanding attention: each token's window per iteration, on a sequence whose token i
    # copies the key of token i − 2 or i − 7 (the prior's first window, 7, just reaches 7)
    m, x = planted_expanding(*((80, 16) if quick else (160, 32)))
    with torch.no_grad():
        _, post, trace = sa.compile(m)(x, return_posterior=True, return_trace=True)
        trace = trace.mean_field["attn"]  # the mean-field windows' history
    ax = fig.add_subplot(grid[0, :2])
    w = trace.windows[:, 0, 0].double()  # (T, n)
    im = ax.imshow(w.T.numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("mean-field iteration (round)")
    ax.set_ylabel("token i")
    ax.set_title("expanding attention: each token's window W_i per iteration\n"
                 "(true parent 2 or 7 back: windows grow only where the posterior leans far)",
                 fontsize=10)
    fig.colorbar(im, ax=ax, label="window")
    ax = fig.add_subplot(grid[0, 2:])
    ax.imshow(post[0, 0, :40, :40].numpy(), cmap="Blues", vmin=0, vmax=1)
    ax.set_title("its posterior p(φ_i = j | x), first 40 tokens", fontsize=10)
    ax.set_xlabel("parent j")
    ax.set_ylabel("child i")
    # slot attention: assignments per iteration
    torch.manual_seed(2)
    slots = sa.models.slot_attention(3, 8, iters=3, hidden_dim=16, recipe="collapsed",
                                     temperature=0.1)
    centres = torch.randn(3, 8) * 3
    pts = (centres.repeat_interleave(10, 0) + 0.5 * torch.randn(30, 8))[None]  # 3 clusters
    with torch.no_grad():
        start = pts[:, [0, 1, 12]] + 0.3 * torch.randn(1, 3, 8)  # two slots start in cluster 0
        _, tr = sa.compile(slots)(pts, start, return_trace=True, trace_posteriors=True)
    fam = next(iter(tr.posteriors))
    steps = tr.posteriors[fam].shape[0]
    for t in range(min(steps, 2)):
        ax = fig.add_subplot(grid[1, t])
        p = tr.posteriors[fam][[0, steps - 1][t], 0, 0]  # (inputs, slots)
        ax.imshow(p.T.numpy(), aspect="auto", cmap="Oranges", vmin=0, vmax=1)
        ax.set_title(f"slot attention (collapsed): p(slot | input)\nstep {[0, steps - 1][t]}",
                     fontsize=10)
        ax.set_xlabel("input (clusters: 0–9, 10–19, 20–29)")
        ax.set_ylabel("slot")
    # multihop: P and P² (hop 1 and hop 2 paths)
    torch.manual_seed(3)
    mh = sa.models.multihop_attention(8, heads=1, causal=True)
    xm = torch.randn(1, 10, 8) * 3
    with torch.no_grad():
        _, posts = sa.compile(mh)(xm, return_posterior=True)
    P = posts if isinstance(posts, torch.Tensor) else next(iter(posts.values()))
    P = P[0, 0]
    for k, (mat, label) in enumerate(((P, "P: one hop"), (P @ P, "P²: two hops (paths)"))):
        ax = fig.add_subplot(grid[1, 2 + k])
        ax.imshow(mat.numpy(), cmap="Greens", vmin=0, vmax=1)
        ax.set_title(f"multihop: {label}", fontsize=10)
        ax.set_xlabel("parent j")
        ax.set_ylabel("child i")
    return save(fig, os.path.join(out, "structures_dynamics.png"), dpi=90)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "output",
                                                  "structures"))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    names = sorted(sa.models.REGISTRY)
    if args.quick:
        names = ["self_attention", "expanding_attention", "hopfield", "block_slot_attention"]
    written = []
    for name in names:
        written += draw_model(name, args.out)
    written.append(sheet(names, args.out))
    written.append(dynamics(args.out, args.quick))
    written.append(long_sequence(args.out, args.quick))
    for w in written:
        print(w)
    return written


if __name__ == "__main__":
    main()
