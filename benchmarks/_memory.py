"""Peak-memory measurement on CPU, shared by the benchmarks.

``ru_maxrss`` cannot be reset and already holds import-time peaks, so a peak is the
RSS high-water mark (VmHWM) after the measured work minus the mark right before it,
reset to the current RSS there (malloc_trim + ``/proc/self/clear_refs``).
"""

from __future__ import annotations

import os
import resource


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def peak_rss_kib() -> tuple[int, str]:
    """The process's RSS high-water mark in KiB: VmHWM from /proc/self/status (resettable,
    see below) where available, else ru_maxrss (which also keeps the peak of exited
    threads' view of the mm, so it cannot be reset)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]), "VmHWM"
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss"


def release_and_reset_peak() -> bool:
    """Return freed heap pages to the OS (glibc malloc_trim) and, where Linux allows it,
    reset the RSS high-water mark (ru_maxrss / VmHWM) to the current RSS by writing 5 to
    /proc/self/clear_refs. Returns whether the reset happened."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_peak_mib(fn) -> float:
    """Run ``fn()`` and return the growth of the RSS high-water mark during it, MiB."""
    release_and_reset_peak()
    before = peak_rss_kib()[0]
    fn()
    return (peak_rss_kib()[0] - before) / 1024
