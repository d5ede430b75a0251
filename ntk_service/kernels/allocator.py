"""Process memory tuning for kernels (Linux/glibc): keep freed memory in the process instead of handing it back
to the OS after every kernel, and back large fresh buffers with transparent huge pages.

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
import functools
import sys
import threading
from collections.abc import Callable

import torch

__all__ = [
    "HUGE_PAGE_BYTES",
    "MMAP_THRESHOLD_BYTES",
    "TRIM_THRESHOLD_BYTES",
    "prefer_huge_pages",
    "retain_freed_memory",
]

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


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, or None where there is none to load (not Linux)."""
    name = ctypes.util.find_library("c") if sys.platform == "linux" else None
    if name is None:
        return None
    try:
        return ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None


def _mallopt(option: int, value: int) -> bool:
    mallopt = getattr(_libc(), "mallopt", None)  # glibc only
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(option, value))


HUGE_PAGE_BYTES = 2 * 1024 * 1024
"""x86-64 transparent huge page size; buffers spanning at least two of them are advised to use them."""

_MADV_HUGEPAGE = 14  # linux/mman.h


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise, or None off Linux/glibc."""
    madvise = getattr(_libc(), "madvise", None)
    if madvise is None:
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise  # type: ignore[no-any-return]


def prefer_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """Ask the kernel to back the untouched memory of ``t`` with transparent huge pages; returns ``t``.

    NOTE [huge pages]: a buffer above the mmap threshold (the δ of a CNN's first convolution: 74 MB at 64
    examples) is fresh memory on every call and its first touch costs a page fault per 4 KiB: filling it took
    28-33 ms, 10-12 ms after ``madvise(MADV_HUGEPAGE)`` (transparent huge pages in "madvise" mode, the common
    default). Advice only: it changes no value, and where it is not honoured (THP off, not Linux) nothing happens.
    """
    if t.device.type != "cpu":  # host memory advice: a GPU buffer has no pages here
        return t
    madvise = _madvise()
    start = t.data_ptr()
    end = start + t.untyped_storage().nbytes()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if madvise is not None and last > first:
        madvise(first, last - first, _MADV_HUGEPAGE)
    return t
