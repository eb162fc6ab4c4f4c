"""What ``import structattn`` costs over ``import torch``: fresh processes, paired.

Each round runs ``python -c "import torch"`` and ``python -c "import structattn"`` in fresh
interpreters, one after the other (the order alternating from round to round), from this
checkout's root, so that its ``structattn`` is the one imported; a round's ratio is the
second's wall time over the first's, the interpreter's own start-up included in both. The
figures are the medians over rounds (target: ratio ≤ 1.05). Each run's CPU time (user +
system, from ``getrusage``) is kept too, with its own paired ratio: on a machine other work
shares it leaves out the time spent waiting for a core. Python's bytecode cache is on, as
for an installed package (``PYTHONDONTWRITEBYTECODE`` is cleared for the runs, and a first
import writes the cache); ``--no-bytecode-cache`` keeps the environment's setting, where
without the cache every module of structattn is compiled from source on each import (torch's
own modules come compiled with its wheel). Each record also names the
optional libraries (Pyro, networkx, graphviz, ArviZ, matplotlib) that ``import structattn``
left in ``sys.modules`` — none is needed before a feature that uses it is called.
Run: ``python benchmarks/bench_import.py [--quick] [--rounds N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402  (this script's own folder)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
#: what a plain ``import structattn`` should not import (each is imported on first use)
OPTIONAL = ("pyro", "networkx", "graphviz", "arviz", "matplotlib")
TARGET = 1.05


def environment(bytecode_cache: bool) -> dict:
    """The runs' environment: this one, with Python's bytecode cache on where asked."""
    env = dict(os.environ)
    if bytecode_cache:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wall(code: str, env: dict) -> tuple:
    """(wall seconds, CPU seconds) for a fresh interpreter to run ``code`` and exit."""
    c, t = _children_cpu(), time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True,
                   capture_output=True)
    return time.perf_counter() - t, _children_cpu() - c


def loaded_optional(env: dict) -> list:
    """The libraries of ``OPTIONAL`` in ``sys.modules`` after ``import structattn``."""
    code = f"import json, sys, structattn; print(json.dumps([m for m in {OPTIONAL!r} " \
           f"if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def measure(rounds: int, bytecode_cache: bool = True, log=print) -> dict:
    """``rounds`` interleaved pairs of fresh imports; medians and the median paired ratio."""
    env = environment(bytecode_cache)
    wall("import structattn", env)  # the file cache warm, the bytecode cache written
    torch_s, sa_s = [], []
    pair = (("import torch", torch_s), ("import structattn", sa_s))
    for r in range(rounds):
        for code, times in (pair if r % 2 == 0 else pair[::-1]):
            times.append(wall(code, env))
    ratios = [s[0] / t[0] for s, t in zip(sa_s, torch_s, strict=True)]
    cpu_ratios = [s[1] / t[1] for s, t in zip(sa_s, torch_s, strict=True)]
    res = {"rounds": rounds, "bytecode_cache": bytecode_cache,
           "import_torch_s": statistics.median(t[0] for t in torch_s),
           "import_structattn_s": statistics.median(s[0] for s in sa_s),
           "paired": statistics.median(ratios), "paired_min": min(ratios),
           "paired_max": max(ratios),
           "import_torch_cpu_s": statistics.median(t[1] for t in torch_s),
           "import_structattn_cpu_s": statistics.median(s[1] for s in sa_s),
           "paired_cpu": statistics.median(cpu_ratios), "paired_cpu_min": min(cpu_ratios),
           "paired_cpu_max": max(cpu_ratios), "optional_loaded": loaded_optional(env)}
    ok = "OK" if res["paired"] <= TARGET else "MISS"
    cache = "on" if bytecode_cache else "off"
    log(f"fresh processes, {rounds} pairs, bytecode cache {cache}: import torch "
        f"{res['import_torch_s']:.2f} s, import "
        f"structattn {res['import_structattn_s']:.2f} s; paired ratio {res['paired']:.3f}× "
        f"(range {res['paired_min']:.3f}–{res['paired_max']:.3f}; target ≤ {TARGET}: {ok})")
    log(f"CPU time: import torch {res['import_torch_cpu_s']:.2f} s, import structattn "
        f"{res['import_structattn_cpu_s']:.2f} s; paired ratio {res['paired_cpu']:.3f}× (range "
        f"{res['paired_cpu_min']:.3f}–{res['paired_cpu_max']:.3f})")
    log(f"optional libraries imported by `import structattn`: "
        f"{', '.join(res['optional_loaded']) or 'none'}")
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one pair (smoke test)")
    p.add_argument("--rounds", type=int, default=20, help="pairs of fresh processes (20)")
    p.add_argument("--no-bytecode-cache", action="store_true",
                   help="keep PYTHONDONTWRITEBYTECODE as the environment sets it")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    res = measure(1 if args.quick else args.rounds, bytecode_cache=not args.no_bytecode_cache)
    _results.save("import", res, args.json, quick=args.quick)
    return res


if __name__ == "__main__":
    main()
