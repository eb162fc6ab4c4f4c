"""Render the measurements in ``benchmarks/results/`` as the pictures the docs show.

Reads the JSON each benchmark writes (``{"provenance": …, "results": …}``) and draws, into
``docs/benchmarks/img/`` (or ``--out``):

- ``distance_priors.png``: each distance prior's forward+backward time and peak memory as a
  ratio to causal SDPA, at every N measured on the CPU (``distance_priors*.json``);
- ``gpu_kernels.png``: the Triton kernels' time against N beside FLA's and causal
  FlashAttention SDPA's (``gpu_kernels.json``), one panel per kernel;
- ``expanding.png``: expanding attention's speed-up over full causal SDPA per variant and N
  (``expanding.json``);
- ``gpu_layers.png``: each compiled layer's forward+backward time and peak memory over the
  same projections around causal SDPA, per N (``gpu_layers.json``, ``bench_gpu_layers.py``
  on a GPU); its table, the same ratios with FLA's beside FoX and stick-breaking, is printed
  in markdown for the docs (``gpu_layers_table``).

Each picture names the machine it was measured on (the provenance). A result file that is
missing leaves its picture out. Run: ``python benchmarks/render_results.py [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
OUT = os.path.join(HERE, "..", "docs", "benchmarks", "img")


def _load(name: str):
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _machine(data) -> str:
    """Where a result was measured: the GPU's name, or the CPU's cores and threads."""
    p = data.get("provenance", {})
    device = p.get("device", "")
    if device and device != "cpu":
        return device
    return f"{p.get('cores', '?')}-core CPU, {p.get('threads', '?')} threads"


def _grouped_bars(ax, variants, sizes, value, xlabel: str, label: bool = True) -> None:
    """One horizontal bar per variant and N, ``value(n, variant)``, grouped by variant, on a
    log scale with a dashed line at 1; ``label``: name the variants (and put the first at
    the top) — once per shared axis."""
    height = 0.8 / len(sizes)
    for k, n in enumerate(sizes):
        ax.barh([i + k * height for i in range(len(variants))],
                [value(n, v) for v in variants], height=height, label=f"N = {n:,}")
    ax.axvline(1.0, color="#555555", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    if label:
        ax.set_yticks([i + 0.4 - height / 2 for i in range(len(variants))], variants)
        ax.invert_yaxis()


def _save(fig, out: str, name: str) -> str:
    """Lay ``fig`` out, write it to ``out/name`` and close it; → the path."""
    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def distance_priors(out: str) -> str | None:
    """Time and memory ratios to causal SDPA per prior and N (the CPU's runs)."""
    runs = {}  # N → {variant: row}
    machine = None
    for name in ("distance_priors.json", "distance_priors_certified_16384.json",
                 "distance_priors_gaussian.json"):  # later records replace earlier rows
        data = _load(name)
        if data is None or data.get("provenance", {}).get("device", "cpu") != "cpu":
            continue
        machine = machine or _machine(data)
        for n, rows in data["results"]["runs"].items():
            base = rows.get("causal SDPA", {}).get("peak_bytes")  # each record's own baseline
            runs.setdefault(int(n), {}).update(
                {k: {**v, "memory": v["peak_bytes"] / base if base else float("nan")}
                 for k, v in rows.items() if isinstance(v, dict) and "paired" in v})
    if not runs:
        return None
    sizes = sorted(runs)
    variants = [v for v in dict.fromkeys(k for n in sizes for k in runs[n])
                if v != "causal SDPA"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.42 * len(variants) + 1.8), sharey=True)

    def memory(n, v):
        return runs[n].get(v, {}).get("memory", float("nan"))
    for ax, what, value, first in (
            (axes[0], "forward+backward time",
             lambda n, v: runs[n].get(v, {}).get("paired", float("nan")), True),
            (axes[1], "peak memory", memory, False)):
        _grouped_bars(ax, variants, sizes, value, label=first,
                      xlabel=f"{what} ÷ causal SDPA's (log scale; left of the dashed line: "
                             f"less)")
    axes[1].legend(loc="upper right", fontsize=8)
    fig.suptitle(f"Distance priors against causal SDPA — {machine}, float32", fontsize=11)
    return _save(fig, out, "distance_priors.png")


def gpu_kernels(out: str) -> str | None:
    """The Triton kernels' time against N beside FLA's and SDPA's (one dtype, one panel per
    kernel)."""
    data = _load("gpu_kernels.json")
    if data is None or not data["results"].get("rows"):
        return None
    rows = data["results"]["rows"]
    dtype = rows[0]["dtype"]
    rows = [r for r in rows if r["dtype"] == dtype and r["seconds"]]
    panels = {"FoX": ("FoX (structattn)", "FoX (FLA)"),
              "stick-breaking": ("stick-breaking (structattn)",
                                 "stick-breaking, full scan (structattn)",
                                 "stick-breaking (FLA)")}
    fig, axes = plt.subplots(1, len(panels), figsize=(12, 4.2))
    for ax, (title, methods) in zip(axes, panels.items(), strict=True):
        for method in ("causal SDPA", *methods):
            pts = sorted((r["N"], r["seconds"] * 1e3, f"{r['B']}×{r['H']}, d={r['d']}")
                         for r in rows if r["method"] == method)
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    ls="--" if method == "causal SDPA" else "-", label=method)
        ax.set(xscale="log", yscale="log", xlabel="N, and each point's B×H and head width d",
               ylabel="forward+backward, ms (log scale)", title=title)
        sizes = sorted({(r["N"], f"{r['N']:,}\n{r['B']}×{r['H']}, d={r['d']}") for r in rows})
        ax.set_xticks([n for n, _ in sizes], [label for _, label in sizes])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.legend(fontsize=8)
    fig.suptitle(f"Triton kernels on {data['results'].get('device', _machine(data))}, {dtype}",
                 fontsize=11)
    return _save(fig, out, "gpu_kernels.png")


def expanding(out: str) -> str | None:
    """Expanding attention's speed-up over full causal SDPA per variant and N."""
    data = _load("expanding.json")
    if data is None:
        return None
    rows = [dict(r, variant=re.sub(r", w=\d+\)", ", told the largest distance)",
                                   r["variant"]).strip())
            for r in data["results"]["rows"] if "variant" in r]
    sizes = sorted({r["n"] for r in rows})
    variants = list(dict.fromkeys(r["variant"].strip() for r in rows
                                  if r["variant"] != "full causal SDPA"))
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(variants) + 1.6))
    speedup = {(r["n"], r["variant"]): r["speedup_vs_full"] for r in rows}
    _grouped_bars(ax, variants, sizes, lambda n, v: speedup.get((n, v), float("nan")),
                  xlabel="speed-up over full causal SDPA, forward+backward (log scale)")
    ax.legend(fontsize=8)
    ax.set_title(f"Expanding attention against full causal SDPA — {_machine(data)}",
                 fontsize=10)
    return _save(fig, out, "expanding.png")


def gpu_layers_table(data=None) -> list[str]:
    """``bench_gpu_layers.py``'s record as a markdown table (one row per method, per N its
    time and memory over causal SDPA's, FLA's beside), with a line naming the machine; []
    where no record exists."""
    data = data or _load("gpu_layers.json")
    if data is None or not data["results"].get("rows"):
        return []
    import sys

    sys.path.insert(0, HERE)
    from bench_gpu_layers import table

    r = data["results"]
    c = r.get("config", {})
    return [f"{r.get('device', _machine(data))}, {r.get('dtype')}, B={c.get('batch')} "
            f"H={c.get('heads')} d={c.get('d')}, forward+backward (paired medians):", "",
            *table(r["rows"], None if r.get("fla") else r.get("fla_note"))]


def gpu_layers(out: str) -> str | None:
    """Each compiled layer's time and peak memory over causal SDPA's, per N."""
    data = _load("gpu_layers.json")
    if data is None or not data["results"].get("rows"):
        return None
    rows = [r for r in data["results"]["rows"] if r["seconds"]]
    sizes = sorted({r["N"] for r in rows})
    variants = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "causal SDPA"))
    at = {(r["N"], r["method"]): r for r in rows}

    def ratio(key):
        return lambda n, v: (at.get((n, v)) or {}).get(key) or float("nan")
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.42 * len(variants) + 1.8), sharey=True)
    for ax, what, key, first in ((axes[0], "forward+backward time", "paired_vs_sdpa", True),
                                 (axes[1], "peak memory", "memory_vs_sdpa", False)):
        _grouped_bars(ax, variants, sizes, ratio(key), label=first,
                      xlabel=f"{what} ÷ causal SDPA's (log scale; left of the dashed line: "
                             f"less)")
    axes[1].legend(loc="upper right", fontsize=8)
    r = data["results"]
    fig.suptitle(f"Compiled layers against causal SDPA — {r.get('device', _machine(data))}, "
                 f"{r.get('dtype')}", fontsize=11)
    return _save(fig, out, "gpu_layers.png")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=OUT, help="where the pictures go (default: the docs')")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    written = [w for w in (distance_priors(args.out), gpu_kernels(args.out),
                           expanding(args.out), gpu_layers(args.out)) if w]
    for w in written:
        print(w)
    layers = gpu_layers_table()
    if layers:
        print("\nthe layers on a GPU (docs/benchmarks/index.md, \"On a GPU\"):\n")
        print("\n".join(layers))
    return written


if __name__ == "__main__":
    main()
