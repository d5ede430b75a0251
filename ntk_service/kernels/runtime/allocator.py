"""Process memory tuning for kernels (Linux/glibc): keep freed memory in the process instead of handing it back
to the OS after every kernel, for buffers of a few MB (``retain_freed_memory``) and, on request, for the large
ones too (``reuse_large_buffers``), and give it back on request (``release_freed_memory``).

NOTE [allocator]: a kernel allocates and frees buffers of a few MB (δ's, Grams, theta blocks). With glibc's
default malloc a buffer that size is mmap'ed or carved from a heap top that is trimmed after every free, so the
next kernel's buffers start as fresh pages and fault on first touch: 800-1,400 minor page faults (3-5 MB) per
call of the benchmark MLP kernel at N = M = 64. ``retain_freed_memory`` raises the mmap threshold to glibc's own
ceiling (32 MiB; glibc's dynamic threshold drifts up to it anyway) and the trim threshold to 256 MiB: 0-30 faults
per call, and median times per call of 12.1 -> 11.7, 16.4 -> 15.7 and 19.1 -> 15.5 ms in three alternating pairs
of processes (default, retained) on the noisy shared machine. The cost: up to 256 MiB of freed memory may stay
in the process, reused by the next kernel. The server calls this at start (``kernels.warm_up``), Ray workers
before their first tile; a notebook may call it once. Elsewhere (musl, macOS) it does nothing.

NOTE [large buffers]: past the mmap threshold (32 MiB, glibc's ceiling for it) every buffer is a fresh mapping
that faults a page per 4 KiB on first touch and is unmapped at free: the Jacobians of a real model's side are such
buffers (the transformer's are 17 MiB per example), so each call pays them again, in the tutorial's code as in
ours: on the benchmark transformer at N = M = 64, TRACE, 493k faults and 0.86 s of system time per call for the
tutorial, 428k and 0.65 s for our Jacobian contraction (one process, alternating, contended). With mmap off
(``M_MMAP_MAX`` 0) and no trimming at free, the heap keeps the freed buffers and the next call reuses them: 2 and
7 faults, 0.10 and 0.01 s. Keeping only 256 MiB at the heap top (this module's trim threshold) is not enough: a
free that leaves more trims all of it (320k and 184k faults). Tried and dropped: transparent huge pages for torch's
large buffers (``THP_MEM_ALLOC_ENABLE=1``): 10k-17k faults, but 1.76 s of system time for the tutorial, as the
huge pages are still zeroed on every call; the ``madvise`` helper for them had no caller and is gone. The memory
kept is reused by any later allocation of the process, and ``release_freed_memory`` returns it to the OS. The
kept memory counts as used in MemAvailable, so ``default_memory_budget`` adds ``free_heap_bytes`` back: a call's
budget is what the process could allocate, kept buffers included.
Threads: a thread's own malloc arena cannot grow past 64 MiB and maps larger buffers fresh whatever
``M_MMAP_MAX`` says, so with mmap off alone a kernel in a worker thread (the server's) still faulted ~200k pages
per call (the transformer at N = M = 32, TRACE; 4 calls in the main thread: 393k, 1.3k, 8, 4 faults; then 4 in a
new thread: 262k, 195k, 179k, 220k). ``M_ARENA_MAX`` 1 puts every thread on the main heap: 12.8k, 3, 2, 4 in
the thread in that run, but not reliably: across 12 fresh processes a worker thread still got some or all of five
64 MiB buffers fresh in 8, also with MALLOC_ARENA_MAX=1 in the environment (cause not pinned down), so the
server leaves this off by default (``NTK_REUSE_LARGE_BUFFERS``). The cost is one lock for all threads' mallocs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
import threading

__all__ = [
    "MMAP_THRESHOLD_BYTES",
    "TRIM_THRESHOLD_BYTES",
    "free_heap_bytes",
    "release_freed_memory",
    "retain_freed_memory",
    "reuse_large_buffers",
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


_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def reuse_large_buffers() -> bool:
    """Serve buffers of every size from malloc's heap and keep the freed ones there for the next call, until
    ``release_freed_memory`` (NOTE [large buffers]); True when in effect. Applies ``retain_freed_memory`` first.

    Process-wide and for the process's lifetime: call it once where one process runs many kernels (a script's
    loop, a server, a job worker), at its start, before other threads allocate: every thread then allocates from
    the one main heap (a thread that already has its own arena keeps it). The memory kept is the heap's
    high-water mark, about the largest call's peak, which the engine's plan keeps under its memory budget.

    Returns:
        True when glibc took the settings; False elsewhere (musl, macOS), where nothing changes.
    """
    retained = retain_freed_memory()
    return (
        retained
        and _mallopt(_M_MMAP_MAX, 0)
        and _mallopt(_M_TRIM_THRESHOLD, -1)
        and _mallopt(_M_ARENA_MAX, 1)  # threads too: a thread's own arena maps large buffers fresh regardless
    )


def release_freed_memory() -> bool:
    """Return the freed memory malloc keeps (``retain_freed_memory``, ``reuse_large_buffers``) to the OS now
    (``malloc_trim(0)``), e.g. when a server goes idle or a worker finishes its job.

    Returns:
        True when some memory was returned; False when none was, or off glibc, where there is nothing to do.
    """
    global _released_free_bytes
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    with _lock:
        released = bool(trim(0))
        _released_free_bytes = _fordblks()
    return released


class _Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (malloc.h, glibc >= 2.33): ten size_t counters."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def free_heap_bytes() -> int:
    """Bytes malloc keeps free, and resident, for this process: memory that MemAvailable counts as used but the
    next allocation of this process reuses. The memory budget adds it back (NOTE [large buffers]), so keeping
    buffers (``reuse_large_buffers``) never shrinks the budget of a later call.

    Counted as malloc's free bytes (``mallinfo2().fordblks``) beyond those it held right after the last
    ``release_freed_memory``, whose pages went back to the OS although malloc still lists them: a lower bound
    (a released chunk reused and freed again is resident but not counted), never an overestimate.

    Returns:
        The bytes; 0 off glibc (or before 2.33), where nothing is kept this way.
    """
    return max(0, _fordblks() - _released_free_bytes)


_released_free_bytes = 0
"""``mallinfo2().fordblks`` right after the last ``release_freed_memory`` (0 before any): free, not resident."""


def _fordblks() -> int:
    mallinfo2 = getattr(_libc(), "mallinfo2", None)
    if mallinfo2 is None:
        return 0
    mallinfo2.argtypes, mallinfo2.restype = [], _Mallinfo2
    return int(mallinfo2().fordblks)
