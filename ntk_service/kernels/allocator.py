"""Keep freed memory in the process instead of handing it back to the OS after every kernel (glibc only).

NOTE [allocator]: a kernel allocates and frees buffers of a few MB (δ's, Grams, theta blocks). With glibc's
default malloc a buffer that size is mmap'ed or carved from a heap top that is trimmed after every free, so the
next kernel's buffers start as fresh pages and fault on first touch: 800-1,400 minor page faults (3-5 MB) per
call of the benchmark MLP kernel at N = M = 64. ``retain_freed_memory`` raises the mmap threshold to glibc's own
ceiling (32 MiB; glibc's dynamic threshold drifts up to it anyway) and the trim threshold to 256 MiB: 0-30 faults
per call, and median times per call of 12.1 -> 11.7, 16.4 -> 15.7 and 19.1 -> 15.5 ms in three alternating pairs
of processes (default, retained) on the noisy shared machine. The cost: up to 256 MiB of freed memory may stay
in the process, reused by the next kernel. The server calls this at start (``kernels.warm_up``), Ray workers
before their first tile; a notebook may call it once. Elsewhere (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

__all__ = ["MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "retain_freed_memory"]

MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
"""Allocations below this come from the heap (glibc refuses larger values)."""

TRIM_THRESHOLD_BYTES = 256 * 1024 * 1024
"""Free memory at the heap top kept before glibc returns it to the OS."""

_M_TRIM_THRESHOLD = -1  # glibc malloc.h
_M_MMAP_THRESHOLD = -3

_lock = threading.Lock()
_applied: bool | None = None


def retain_freed_memory() -> bool:
    """Tune glibc malloc once per process (NOTE [allocator]); True when the settings are in effect."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and _mallopt(
                _M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES
            )
        return _applied


def _mallopt(option: int, value: int) -> bool:
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(option, value))
