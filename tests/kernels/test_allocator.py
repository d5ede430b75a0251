"""glibc malloc tuning (runtime/allocator.py): large buffers reused across calls and returned on request, measured in a
fresh process each (the settings are process-wide) by its page faults and resident memory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ntk_service.kernels.runtime.device import DEFAULT_MEMORY_FRACTION

_PROGRAM = """
import json, resource, sys, torch
from ntk_service.kernels.runtime.allocator import release_freed_memory, retain_freed_memory, reuse_large_buffers
assert (retain_freed_memory if sys.argv[1] == "retain" else reuse_large_buffers)()

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

def calls():
    for _ in range(3):
        torch.ones(16 * 2**20)  # 64 MiB, past the mmap threshold: allocated, touched and freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        torch.ones(16 * 2**20)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults = calls()
kept = rss_kib()
released = release_freed_memory()
print(json.dumps({"faults": faults, "kept_kib": kept, "after_kib": rss_kib(), "released": released}))
"""


def _run(how: str) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", _PROGRAM, how], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_large_buffers_are_reused_across_calls_and_released_on_request() -> None:
    """Five 64 MiB buffers fault ~16k pages each when mapped fresh (retain_freed_memory alone); with
    reuse_large_buffers the heap serves them from the first ones' pages, in the main thread and in a worker thread
    (whose own arena would map them fresh), and release_freed_memory gives those pages back to the OS."""
    fresh, reused = _run("retain"), _run("reuse")
    assert fresh["faults"] > 5 * 10_000, f"fresh mappings faulted only {fresh['faults']}: nothing to compare with"
    # At most one of the five buffers fresh: glibc's heap settles within a few calls (in a worker thread one call
    # in a few runs still got fresh pages), where fresh mappings fault all five every time.
    assert reused["faults"] * 4 < fresh["faults"], f"{reused['faults']} faults reused vs {fresh['faults']} fresh"
    assert reused["released"]
    assert reused["kept_kib"] - reused["after_kib"] > 48 * 1024, f"released too little: {reused}"


_BUDGET_PROGRAM = """
import json, torch
from ntk_service.kernels.runtime import allocator, device
assert allocator.reuse_large_buffers()
before = allocator.free_heap_bytes()
torch.ones(64 * 2**20)  # 256 MiB from the heap, freed at once and kept there
kept = allocator.free_heap_bytes()
available = device._available_bytes()
budget = device.default_memory_budget()
allocator.release_freed_memory()
print(json.dumps({"before": before, "kept": kept, "available": available, "budget": budget,
                  "after": allocator.free_heap_bytes()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_memory_the_heap_keeps_counts_in_the_budget() -> None:
    """A kept 256 MiB buffer is free for this process though MemAvailable counts it used: free_heap_bytes sees it,
    the default budget adds it back (half of MemAvailable + kept, read in the same instant), and once released it is
    no longer counted (MemAvailable has it again)."""
    out = subprocess.run([sys.executable, "-c", _BUDGET_PROGRAM], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["kept"] - r["before"] >= 255 * 2**20, r
    expected = (r["available"] + r["kept"]) * DEFAULT_MEMORY_FRACTION
    assert abs(r["budget"] - expected) < 64 * 2**20, r  # MemAvailable may move a little between the two reads
    assert r["after"] == 0, r  # released: back with the OS, no longer counted
