"""The key-bias kernels' launch settings (``key_bias.py``): the blocks, warps and stages each
kernel runs with, by dtype, padded width and device."""

from __future__ import annotations

import torch

from . import interpreted
from ._tiles import settings, width

#: launch settings that replace ``settings``'s, set at run time (``benchmarks/
#: tune_key_bias.py`` measures them): ``(kernel, dtype, padded width) → {BM, BN, num_warps,
#: num_stages}``, kernel "forward", "children" (da) or "parents" (db, du, dh)
TUNED: dict = {}

#: half precision on a GPU with ≥ 200 KiB of shared memory per block (H100, H200), by kernel
#: and padded width (≤ 64, 128): the fastest of tune_key_bias.py's candidates on an H100
#: (bfloat16; B×H×N×d = 8×8×1,024×64, 4×8×4,096×64, 1×4×16,384×128). Four warps where
#: ``settings`` gave eight cut the backward at d = 128 by half (6.6 → 3.5 ms at N = 16,384)
MEASURED = {("forward", 64): dict(BM=64, BN=64, num_warps=4, num_stages=3),
            ("forward", 128): dict(BM=128, BN=128, num_warps=8, num_stages=2),
            ("children", 64): dict(BM=64, BN=64, num_warps=4, num_stages=2),
            ("children", 128): dict(BM=64, BN=32, num_warps=4, num_stages=3),
            ("parents", 64): dict(BM=64, BN=64, num_warps=4, num_stages=2),
            ("parents", 128): dict(BM=64, BN=64, num_warps=4, num_stages=2)}


def common(dtype: torch.dtype, K: int, D: int, causal: bool, window, children: int = 128,
            parents: int = 64, kernel: str = "forward", device=None) -> dict:
    BK, BD = width(K), width(D)
    widest = max(BK, BD)
    out = dict(settings(dtype, widest, children, parents), CAUSAL=causal, BK=BK, BD=BD,
               WINDOWED=window is not None)
    if interpreted():
        return out
    if dtype in (torch.float16, torch.bfloat16) and widest <= 128 and _roomy(device):
        out.update(MEASURED[(kernel, 64 if widest <= 64 else 128)])
    out.update(TUNED.get((kernel, dtype, widest), {}))
    return out


_ROOM: dict = {}


def _roomy(device) -> bool:
    """Whether ``device`` (a CUDA device) offers ≥ 200 KiB of shared memory per block."""
    if device is None or device.type != "cuda":
        return False
    if device not in _ROOM:
        props = torch.cuda.get_device_properties(device)
        _ROOM[device] = getattr(props, "shared_memory_per_block_optin", 0) >= 200 * 1024
    return _ROOM[device]
