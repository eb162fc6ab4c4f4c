"""Timing and peak memory on either device, shared by the benchmarks that take ``--device``."""

from __future__ import annotations

import torch


def sync(device) -> None:
    """On a GPU a call only queues kernels: wait for them before reading the clock (on the
    CPU there is nothing to wait for)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_peak_bytes(run, device) -> int:
    """The CUDA caching allocator's peak during ``run()``, over what was allocated before."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
