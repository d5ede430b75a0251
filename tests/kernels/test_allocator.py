"""glibc malloc tuning (allocator.py): large buffers reused across calls and returned on request, measured in a
fresh process each (the settings are process-wide) by its page faults and resident memory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROGRAM = """
import json, resource, sys, threading, torch
from ntk_service.kernels.allocator import release_freed_memory, retain_freed_memory, reuse_large_buffers
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

if sys.argv[1] == "reuse-in-thread":  # as a server computes: in a worker thread
    result = []
    worker = threading.Thread(target=lambda: result.append(calls()))
    worker.start()
    worker.join()
    faults = result[0]
else:
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
    fresh, reused, in_thread = _run("retain"), _run("reuse"), _run("reuse-in-thread")
    assert fresh["faults"] > 5 * 10_000, f"fresh mappings faulted only {fresh['faults']}: nothing to compare with"
    # At most one of the five buffers fresh: glibc's heap settles within a few calls (in a worker thread one call
    # in a few runs still got fresh pages), where fresh mappings fault all five every time.
    assert reused["faults"] * 4 < fresh["faults"], f"{reused['faults']} faults reused vs {fresh['faults']} fresh"
    assert in_thread["faults"] * 4 < fresh["faults"], f"{in_thread['faults']} faults in a worker thread"
    assert reused["released"]
    assert reused["kept_kib"] - reused["after_kib"] > 48 * 1024, f"released too little: {reused}"
