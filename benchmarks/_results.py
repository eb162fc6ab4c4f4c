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
    ("AVX-512", "AVX2" or "other"), the one structattn's C++ kernels were compiled for
    (``kernel_isa``: the machine's with ``-march=native``, "AVX2" with
    ``STRUCTATTN_KERNEL_ISA=avx2``), the one PyTorch's kernels dispatch to
    (``get_cpu_capability``) and the variables that held PyTorch to AVX2 (``isa_caps``)."""
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
    chosen = os.environ.get("STRUCTATTN_KERNEL_ISA", "native").strip().lower() or "native"
    return {"cpu_model": model or platform.processor() or None, "cpu_isa": isa,
            "kernel_isa": {"native": isa, "avx2": "AVX2"}.get(chosen, chosen),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            **({"isa_caps": caps} if (caps := {k: os.environ[k] for k in AVX2 if k in os.environ
                                               and k != "STRUCTATTN_KERNEL_ISA"}) else {})}


#: the environment of an AVX2 machine on an AVX-512 one: structattn's kernels built for AVX2
#: (x86-64-v3) and PyTorch's own — ATen's dispatch, MKL, oneDNN — held to AVX2
AVX2 = {"STRUCTATTN_KERNEL_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def run_as(isa: str | None) -> None:
    """Run this script on the instruction set ``isa`` ("avx2": ``AVX2`` above; "native" or
    None: as the machine is): where the environment differs, the script starts again in one
    that matches (ATen, MKL and oneDNN read theirs when torch is imported). The record's
    provenance names it (``kernel_isa``, ``torch_cpu_capability``, ``isa_caps``)."""
    import sys

    if isa is None:
        return
    if isa not in ("native", "avx2"):
        raise ValueError(f"isa: expected 'native' or 'avx2', got {isa!r}")
    env = {k: v for k, v in os.environ.items() if k not in AVX2}  # native: the machine's
    if isa == "avx2":
        env.update(AVX2)
    if all(os.environ.get(k) == env.get(k) for k in AVX2):
        return  # already so
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


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
