"""Benchmark results as data: one JSON file per benchmark under ``benchmarks/results/``, with
what produced it — the machine, torch, Python, the commit and the date — so that a table in
the documents can say which run it quotes."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def cpu() -> dict:
    """The CPU a figure came from: its model, the widest vector instruction set it has
    ("AVX-512", "AVX2" or "other": what the C++ kernels, built with ``-march=native``, were
    compiled for) and the one PyTorch's kernels dispatch to (``get_cpu_capability``)."""
    flags, model = set(), None
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "flags" and not flags:
                    flags = set(value.split())
                elif key.strip() == "model name" and model is None:
                    model = value.strip()
    except OSError:  # not Linux: the flags are not read
        pass
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "other"
    return {"cpu_model": model or platform.processor() or None, "cpu_isa": isa,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def provenance(device=None) -> dict:
    """What a measurement depends on besides the code: machine, versions, commit, date."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit or None, "torch": torch.__version__,
            "python": platform.python_version(), "machine": platform.machine(),
            "processor": platform.processor() or None, "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), **cpu(),
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}


def save(name: str, results, path: str | None = None, *, quick: bool = False,
         device=None) -> str | None:
    """Write ``{"provenance": …, "results": results}`` to ``path``, or — for a full run with
    no path — to ``benchmarks/results/<name>.json`` (a ``--quick`` smoke run writes only where
    asked). Returns the path written, or None."""
    if path is None:
        if quick:
            return None
        os.makedirs(RESULTS, exist_ok=True)
        path = os.path.join(RESULTS, f"{name}.json")
    else:
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as fh:
        json.dump({"provenance": provenance(device), "results": results}, fh, indent=1,
                  default=str)
    return path
