"""Multihop attention on the toy task
==================================

Multihop attention on the paper's toy task (§5.1): one layer, two layers, multihop.

Data (REFERENCE.md, the authors' generator): per problem instance A ~ U[0,1)^{D×D} and
W ~ N(1, 1)^{1×D}; per sample a chain z₀ ~ U[0,10)^D, z_k = z_{k−1}A + N(0, 1) (k = 1, 2),
T − 3 distractors ~ N(0, 1)^D; the last token is z₂ (the query), the others are
shuffled; the target is y = W(2z₀ + z₁ + z₂). Answering needs z₀, which is reachable from
the query only through z₁: a two-step walk on the attention graph.

Models (same optimiser, steps and batches; single head, d_k = D, d_v = 1, read out at
the last token):

- one layer:  y = [P V X]_last                               (self attention)
- two layers: h = X + P₁ V₁ X;  y = [P₂ V₂ h]_last             (self attention twice)
- multihop:   y = [Σ_k w_k P^k V X]_last, w = (⅓, ⅓, ⅓)       (the authors' (I + P + P²)/3)

Adam (lr 1e-3, weight decay 2), batch 200, 20,000 steps, 10 seeds in the paper's
setting; ``--quick`` is a tiny run for the test suite. Writes learning curves (median
and inter-quartile band over seeds) and a table of final MSE on held-out samples.
Run: ``python gallery/plot_multihop.py [--steps N] [--seeds S] [--out DIR] [--quick]``
"""
# mkdocs_gallery_thumbnail_path = "../gallery/results/multihop_learning_curves.png"

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import structattn as sa  # noqa: E402


class ChainProblem:
    """One instance of the toy task: fixed A and W, fresh chains per sample."""

    def __init__(self, D=3, T=5, *, generator: torch.Generator):
        if T < 3:
            raise ValueError(f"T must be ≥ 3 (z₀, z₁ and the query z₂); got {T}")
        self.D, self.T, self.g = D, T, generator
        self.A = torch.rand(D, D, generator=generator)
        self.W = torch.randn(1, D, generator=generator) + 1.0

    def sample(self, batch: int):
        """X: (batch, T, D) with the query z₂ last; y: (batch, 1)."""
        g, D = self.g, self.D
        z0 = 10 * torch.rand(batch, D, generator=g)
        z1 = z0 @ self.A + torch.randn(batch, D, generator=g)
        z2 = z1 @ self.A + torch.randn(batch, D, generator=g)
        distractors = torch.randn(batch, self.T - 3, D, generator=g)
        context = torch.cat([z0[:, None], z1[:, None], distractors], dim=1)  # (batch, T−1, D)
        order = torch.rand(batch, self.T - 1, generator=g).argsort(-1)
        context = context.gather(1, order[..., None].expand_as(context))
        X = torch.cat([context, z2[:, None]], dim=1)
        y = (2 * z0 + z1 + z2) @ self.W.T
        return X, y


class TwoLayers(torch.nn.Module):
    """Self attention twice, with a residual in between."""

    def __init__(self, D):
        super().__init__()
        self.first = sa.compile(sa.models.self_attention(D, d_k=D, d_v=D, out_proj=False))
        self.second = sa.compile(sa.models.self_attention(D, d_k=D, d_v=1, out_proj=False))

    def forward(self, x):
        return self.second(x + self.first(x))


def make_models(D):
    return {
        "one layer": sa.compile(sa.models.self_attention(D, d_k=D, d_v=1, out_proj=False)),
        "two layers": TwoLayers(D),
        "multihop": sa.compile(sa.models.multihop_attention(
            D, d_k=D, d_v=1, out_proj=False, hop_weights=(1 / 3, 1 / 3, 1 / 3))),
    }


def train(model, problem, *, steps, batch, lr, weight_decay, record_every, eval_X, eval_y):
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    curve = []
    for step in range(steps):
        X, y = problem.sample(batch)
        loss = torch.nn.functional.mse_loss(model(X)[:, -1], y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % record_every == 0 or step == steps - 1:
            curve.append((step, loss.item()))
    with torch.no_grad():
        final = torch.nn.functional.mse_loss(model(eval_X)[:, -1], eval_y).item()
    return curve, final


def run(args):
    results = {}
    seeds = range(args.seeds)
    start = time.perf_counter()
    for seed in tqdm(seeds, desc="seeds", disable=args.quiet):
        g = torch.Generator().manual_seed(seed)
        problem = ChainProblem(args.D, args.T, generator=g)
        eval_X, eval_y = problem.sample(args.eval_samples)
        for name in make_models(args.D):
            torch.manual_seed(1000 + seed)
            model = make_models(args.D)[name]
            problem.g.manual_seed(10_000 + seed)  # every model sees the same batches
            curve, final = train(model, problem, steps=args.steps, batch=args.batch, lr=args.lr,
                                 weight_decay=args.weight_decay, record_every=args.record_every,
                                 eval_X=eval_X, eval_y=eval_y)
            results.setdefault(name, []).append({"seed": seed, "curve": curve, "final_mse": final})
    return results, time.perf_counter() - start


def summary_table(results) -> str:
    lines = ["| model | params | final MSE median | mean | min | max |", "|---|---|---|---|---|---|"]
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in make_models(3).items()}
    for name, runs in results.items():
        f = [r["final_mse"] for r in runs]
        lines.append(f"| {name} | {params[name]} | {statistics.median(f):.1f} | "
                     f"{statistics.fmean(f):.1f} | {min(f):.1f} | {max(f):.1f} |")
    return "\n".join(lines)


def plot(results, path, title):
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colours = {"one layer": "#1f77b4", "two layers": "#2ca02c", "multihop": "#d62728"}
    for name, runs in results.items():
        steps = [s for s, _ in runs[0]["curve"]]
        losses = torch.tensor([[loss for _, loss in r["curve"]] for r in runs])
        q = torch.quantile(losses, torch.tensor([0.25, 0.5, 0.75]), dim=0)
        ax.plot(steps, q[1], label=f"{name} (median)", color=colours.get(name))
        ax.fill_between(steps, q[0], q[2], alpha=0.2, color=colours.get(name))
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("training MSE (last token)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--D", type=int, default=3, help="token dimension")
    p.add_argument("--T", type=int, default=5, help="tokens per sequence (z₀, z₁, T−3 distractors, z₂)")
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--batch", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=2.0)
    p.add_argument("--record-every", type=int, default=250)
    p.add_argument("--eval-samples", type=int, default=5000)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "output", "multihop"))
    p.add_argument("--quick", action="store_true", help="tiny run (test suite)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.record_every, args.eval_samples = 60, 2, 20, 200
        args.quiet = True
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    results, seconds = run(args)
    table = summary_table(results)
    print(table)
    print(f"({args.seeds} seeds × {args.steps} steps × 3 models in {seconds:.0f} s)")
    curves = os.path.join(args.out, "multihop_learning_curves.png")
    plot(results, curves, f"multihop toy task: D={args.D}, T={args.T}, {args.seeds} seeds, "
                          f"median and IQR")
    with open(os.path.join(args.out, "multihop_results.json"), "w") as fh:
        json.dump({"args": vars(args), "seconds": seconds, "results": results}, fh)
    table_path = os.path.join(args.out, "multihop_final_mse.md")
    with open(table_path, "w") as fh:
        fh.write(table + "\n")
    return [curves]


if __name__ == "__main__":
    main()
