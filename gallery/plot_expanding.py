"""Expanding attention on the toy task
===================================

Expanding attention on the paper's toy task (§5.2; REFERENCE.md, "Expanding toy data"),
against full causal self attention.

Data: T = 50 tokens of D features. z₀ ~ U[0, 2)^D, the query z₁ = z₀ A + N(0, 0.1²) is the
last token, z₀ sits x + 1 positions before it with x ~ Geometric(p) (support ≥ 1; resampled
when it would fall off the start), the other 48 tokens are distractors ~ N(0, 0.1²); the
target is y = W z₀ (A ~ U[0, 1)^{D×D}, W ~ N(1, 1) of shape 1 × D, fixed per seed).

Models: one attention layer and a linear read-out of the last token, ŷ = w·h_T + c:
``sa.models.expanding_attention(D, inference=sa.MeanFieldWindows(...))`` (a, b learned,
initialised at ``--a``, ``--b``; windows at tail mass ``--tol``) and ``sa.models.self_attention(D,
causal=True)``. Adam (lr 5e-4 as the authors; no weight decay: with wd 2 neither model
learns in our budget), MSE on the last token, mini-batches of 32 (the authors' code is
batch size 1), ``--steps`` steps, seeds 0…S−1, p ∈ {1/2, 1/5, 1/10, 1/25}, D ∈ {10, 50}.

Writes (``gallery/output/expanding/``):

- ``expanding_learning_curves.png``: test MSE against steps, both models, every (p, D);
- ``expanding_windows.png``: for the trained D = 50 models, the last token's window over the
  mean-field iterations (eight test sequences per p), and the learned prior's mean distance;
- ``expanding_cost.png``: relative cost against full attention per p and D — the authors'
  counted-operations metric for the final token, mean window·(D + iterations + 1)/(T·D), and
  measured wall time of a forward pass (T = 50, and the same task stretched to T = 1,024
  with more distractors) at two scopes: the final token's output (what the loss reads:
  ``layer(x, last=1)`` against a hand-written SDPA call for that token's query) and every
  token's output (the whole layer against the compiled full-attention layer);
- ``expanding_table.csv``: the numbers (also printed as a markdown table).

``--quick``: 60 steps, one seed, p ∈ {1/2, 1/10}, D = 10 (the test suite).
Run: ``python gallery/plot_expanding.py [--steps N] [--seeds S] [--window-rule predictive|edge|evidence]
[--initial-window W] [--tol T] [--out DIR] [--quick]`` (the savings run: ``--window-rule evidence
--initial-window 8 --tol 1e-6 --ds 50``)
"""
# mkdocs_gallery_thumbnail_path = "../gallery/results/expanding_evidence_windows.png"

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import structattn as sa  # noqa: E402

PS = (1 / 2, 1 / 5, 1 / 10, 1 / 25)
AUTHORS_COUNTED = {10: (0.76, 0.95, 1.09, 1.32), 50: (0.59, 0.65, 0.77, 0.90)}


class ToyProblem:
    """The authors' generator, batched."""

    def __init__(self, d, p, T=50, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.d, self.p, self.T = d, p, T
        self.A = torch.rand(d, d, generator=g)
        self.W = torch.randn(1, d, generator=g) + 1.0
        self.g = torch.Generator().manual_seed(seed + 1000)

    def distances(self, n):
        """x + 1 with x ~ Geometric(p) on {1, 2, …}, resampled while it falls off the start."""
        out = torch.empty(n, dtype=torch.long)
        todo = torch.ones(n, dtype=torch.bool)
        while todo.any():
            u = torch.rand(int(todo.sum()), generator=self.g)
            x = (torch.log1p(-u) / math.log1p(-self.p)).floor().long() + 1
            out[todo] = x + 1
            todo = out > self.T - 1
        return out

    def sample(self, n, T=None):
        T = T or self.T
        z0 = 2 * torch.rand(n, self.d, generator=self.g)
        z1 = z0 @ self.A + 0.1 * torch.randn(n, self.d, generator=self.g)
        X = 0.1 * torch.randn(n, T, self.d, generator=self.g)
        dist = self.distances(n)
        X[torch.arange(n), T - 1 - dist] = z0
        X[:, -1] = z1
        return X, z0 @ self.W.T, dist


class Regressor(nn.Module):
    """One attention layer, then ŷ = w·h_T + c from the last token."""

    def __init__(self, attention):
        super().__init__()
        self.attention, self.layer = attention, sa.compile(attention)
        self.readout = nn.Linear(attention.d_model, 1)

    def forward(self, X, **kw):
        out = self.layer(X, **kw)
        h = out[0] if isinstance(out, tuple) else out
        y = self.readout(h[:, -1])
        return (y, *out[1:]) if isinstance(out, tuple) else y


def make(kind, d, args, seed):
    torch.manual_seed(seed)
    if kind == "expanding":
        attn = sa.models.expanding_attention(d, a=args.a, b=args.b, inference=sa.MeanFieldWindows(
            tol=args.tol, update=args.update, expectation=args.expectation,
            window_rule=args.window_rule, initial_window=args.initial_window))
    else:
        attn = sa.models.self_attention(d, causal=True)
    return Regressor(attn)


def train(model, problem, args, Xt, yt):
    prior = [p for n, p in model.named_parameters() if n.endswith("raw_prior")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("raw_prior")]
    groups = [{"params": rest}] + ([{"params": prior, "lr": args.prior_lr}] if prior else [])
    opt = torch.optim.Adam(groups, lr=args.lr)
    curve = []
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            with torch.no_grad():
                curve.append((step, float(((model(Xt) - yt) ** 2).mean())))
        if step == args.steps:
            break
        X, y, _ = problem.sample(args.batch)
        loss = ((model(X) - y) ** 2).mean()
        if args.cost and hasattr(model.attention, "expected_distance"):
            # the prior's mean look-back over T, penalised as Adaptive Span penalises its span
            loss = loss + args.cost * model.attention.expected_distance(problem.T).mean() \
                / problem.T
        opt.zero_grad()
        loss.backward()
        opt.step()
    return curve


def save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def forward_time(fn, X, repeats=7):
    """Median wall time of ``fn(X)`` without a graph (value checks off, as in a benchmark)."""
    with torch.no_grad(), sa.validation(False):
        fn(X)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn(X)
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def full_final_token(model, X):
    """The full model's prediction from the final token alone, hand-written: that token's
    query against every token's key and value, one ``scaled_dot_product_attention`` call
    (the strongest baseline for the output the loss reads)."""
    att = model.attention
    q, k, v = X[:, -1:] @ att.W_q.T, X @ att.W_k.T, X @ att.W_v.T
    h = torch.nn.functional.scaled_dot_product_attention(q, k, v) @ att.W_o.T
    return model.readout(h[:, -1])


def time_ratios(exp, full, X, repeats):
    """Measured time of the expanding model over the full one: the whole layer (every
    token's output), and the final token's output alone (``last=1`` against
    ``full_final_token``), the scope of the authors' counted metric."""
    every = forward_time(exp, X, repeats) / forward_time(full, X, repeats)
    final = forward_time(lambda z: exp(z, last=1), X, 3 * repeats) / forward_time(
        lambda z: full_final_token(full, z), X, 3 * repeats)
    return every, final


def plot_cost(rows, ps, ds, long, out):
    """``expanding_cost.png``: cost relative to full attention per p, one panel per D."""
    fig, axes = plt.subplots(1, len(ds), figsize=(7.0 * len(ds), 4.2), squeeze=False)
    bars = (("counted_ops", "counted operations (authors' metric, final token)"),
            ("time_query_T50", "measured time, final token, T = 50"),
            ("time_query_long", f"measured time, final token, T = {long}"),
            ("time_ratio_T50", "measured time, every token, T = 50"),
            ("time_ratio_long", f"measured time, every token, T = {long}"))
    width = 0.8 / len(bars)
    for c, d in enumerate(ds):
        ax = axes[0, c]
        sel = [r for r in rows if r["d"] == d and r["model"] == "expanding"]
        x = range(len(ps))
        for k, (key, label) in enumerate(bars):
            vals = [statistics.mean(float(r[key]) for r in sel if float(r["p"]) == p)
                    for p in ps]
            ax.bar([i + (k - (len(bars) - 1) / 2) * width for i in x], vals, width=width,
                   label=label)
        if d in AUTHORS_COUNTED:
            ax.plot([i - 2 * width for i in x],
                    [AUTHORS_COUNTED[d][min(range(4), key=lambda k: abs(PS[k] - p))]
                     for p in ps], "k*", ms=9, label="authors' counted (their code)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_yticks([0.1, 0.2, 0.5, 1, 2, 5])
        ax.set_xticks(list(x), [f"1/{round(1 / p)}" for p in ps])
        ax.set_xlabel("p (the parent is x + 1 back, x ~ Geometric(p))", fontsize=8)
        ax.set_ylabel("expanding / full attention (below 1: cheaper)", fontsize=8)
        ax.set_title(f"cost relative to full attention, D = {d}", fontsize=9)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    return save(fig, os.path.join(out, "expanding_cost.png"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--prior-lr", type=float, default=0.02, help="Adam lr of a and b")
    ap.add_argument("--a", type=float, default=8.0)
    ap.add_argument("--b", type=float, default=2.0)
    ap.add_argument("--tol", type=float, default=0.05)
    ap.add_argument("--update", default="conjugate", choices=("conjugate", "accumulate"))
    ap.add_argument("--window-rule", default="predictive", choices=("predictive", "edge", "evidence"))
    ap.add_argument("--cost", type=float, default=0.0,
                    help="λ of the penalty λ·E_prior[min(φ, T)]/T on the learned prior")
    ap.add_argument("--initial-window", type=int, default=None)
    ap.add_argument("--expectation", default="digamma", choices=("digamma", "plug_in"))
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--long", type=int, default=1024, help="T of the stretched timing task")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "output",
                                                  "expanding"))
    ap.add_argument("--ps", type=float, nargs="+", default=list(PS))
    ap.add_argument("--ds", type=int, nargs="+", default=[10, 50])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    ps, ds = tuple(args.ps), tuple(args.ds)
    if args.quick:
        args.steps, args.seeds, args.eval_every, args.long = 60, 1, 20, 256
        ps, ds = (1 / 2, 1 / 10), (10,)
    os.makedirs(args.out, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread, as the authors' runs
    rows, curves, trained = [], {}, {}
    try:
        for d in ds:
            for p in ps:
                for seed in range(args.seeds):
                    problem = ToyProblem(d, p, seed=seed)
                    Xt, yt, dist_t = problem.sample(256)
                    for kind in ("expanding", "full"):
                        model = make(kind, d, args, seed)
                        t0 = time.perf_counter()
                        curve = train(model, problem, args, Xt, yt)
                        curves[(d, p, seed, kind)] = curve
                        trained[(d, p, seed, kind)] = model
                        rows.append(dict(d=d, p=p, seed=seed, model=kind,
                                         test_mse=curve[-1][1],
                                         diverged=not math.isfinite(curve[-1][1]),
                                         train_s=time.perf_counter() - t0))
                    exp, full = trained[(d, p, seed, "expanding")], trained[(d, p, seed, "full")]
                    with torch.no_grad():
                        trace = exp(Xt, return_trace=True)[1].mean_field["attn"]
                    last = trace.windows[-1][:, 0, -1].double()  # the query's final window
                    counted = float(last.mean()) * (d + trace.iterations + 1) / (problem.T * d)
                    hit = float((last >= dist_t.double()).double().mean())
                    Xl, _, _ = problem.sample(8, T=args.long)
                    rows[-2].update(
                        counted_ops=counted, query_window=float(last.mean()),
                        covers_parent=hit, iterations=trace.iterations,
                        prior_a=float(exp.attention.a[0].detach()),
                        prior_b=float(exp.attention.b[0].detach()),
                        **dict(zip(("time_ratio_T50", "time_query_T50"),
                                   time_ratios(exp, full, Xt[:32], 7), strict=True)),
                        **dict(zip(("time_ratio_long", "time_query_long"),
                                   time_ratios(exp, full, Xl, 3), strict=True)))
    finally:
        torch.set_num_threads(threads)

    written = []
    # learning curves
    fig, axes = plt.subplots(len(ds), len(ps), figsize=(3.2 * len(ps), 2.8 * len(ds)),
                             squeeze=False)
    for r, d in enumerate(ds):
        for c, p in enumerate(ps):
            ax = axes[r, c]
            for kind, colour in (("expanding", "tab:blue"), ("full", "tab:orange")):
                for seed in range(args.seeds):
                    steps, mse = zip(*curves[(d, p, seed, kind)], strict=True)
                    ax.plot(steps, mse, color=colour, alpha=0.8,
                            label=("expanding (mean-field)" if kind == "expanding"
                                   else "full causal attention") if seed == 0 else None)
            ax.set_yscale("log")
            ax.set_title(f"D = {d}, p = 1/{round(1 / p)}", fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            if c == 0:
                ax.set_ylabel("test MSE (last token)", fontsize=8)
    axes[0, 0].legend(fontsize=7)
    written.append(save(fig, os.path.join(args.out, "expanding_learning_curves.png")))

    # windows over the mean-field iterations (the largest D)
    d = ds[-1]
    fig, axes = plt.subplots(1, len(ps), figsize=(3.2 * len(ps), 2.8), squeeze=False)
    for c, p in enumerate(ps):
        problem = ToyProblem(d, p, seed=0)
        X, _, dist = problem.sample(8)
        model = trained[(d, p, 0, "expanding")]
        with torch.no_grad():
            trace = model(X, return_trace=True)[1].mean_field["attn"]
        w = trace.windows[:, :, 0, -1].double()  # (T, 8): the query's window per iteration
        ax = axes[0, c]
        for k in range(8):
            line, = ax.plot(range(1, w.shape[0] + 1), w[:, k], marker="o", ms=3)
            ax.axhline(float(dist[k]), color=line.get_color(), ls=":", lw=0.8)
        ax.set_title(f"D = {d}, p = 1/{round(1 / p)}", fontsize=9)
        ax.set_xlabel("mean-field iteration", fontsize=8)
        if c == 0:
            ax.set_ylabel("query's window (dotted: true distance)", fontsize=8)
    written.append(save(fig, os.path.join(args.out, "expanding_windows.png")))

    written.append(plot_cost(rows, ps, ds, args.long, args.out))

    path = os.path.join(args.out, "expanding_table.csv")
    keys = sorted({k for r in rows for k in r})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    written.append(path)

    print("| D | p | expanding MSE | full MSE | query window | covers parent | iterations | "
          "counted ops | time, final token, T=50 | T=" + str(args.long) + " | time, every token, "
          "T=50 | T=" + str(args.long) + " | learned E[φ] prior |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for d in ds:
        for p in ps:
            e = [r for r in rows if r["d"] == d and r["p"] == p and r["model"] == "expanding"]
            f_ = [r for r in rows if r["d"] == d and r["p"] == p and r["model"] == "full"]

            def mean(key, rs):
                return statistics.mean(r[key] for r in rs)
            pa, pb = mean("prior_a", e), mean("prior_b", e)
            prior_mean = 1 + pa / (pb - 1) if pb > 1 else math.inf
            print(f"| {d} | 1/{round(1 / p)} | {mean('test_mse', e):.3g} | "
                  f"{mean('test_mse', f_):.3g} | {mean('query_window', e):.1f} | "
                  f"{mean('covers_parent', e):.0%} | {mean('iterations', e):.1f} | "
                  f"{mean('counted_ops', e):.2f} | {mean('time_query_T50', e):.2f} | "
                  f"{mean('time_query_long', e):.2f} | {mean('time_ratio_T50', e):.2f} | "
                  f"{mean('time_ratio_long', e):.2f} | {prior_mean:.1f} |")
    print("diverged runs:", sum(r["diverged"] for r in rows))
    return written


if __name__ == "__main__":
    main()
