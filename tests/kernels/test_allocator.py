"""glibc malloc tuning (allocator.py): large buffers reused across calls and returned on request, measured in a
fresh process each (the settings are process-wide) by its page faults and resident memory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROGRAM = """
import json, resource, sys, torch
from ntk_service.kernels.allocator import release_freed_memory, retain_freed_memory, reuse_large_buffers
assert (reuse_large_buffers if sys.argv[1] == "reuse" else retain_freed_memory)()

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

for _ in range(2):
    torch.ones(16 * 2**20)  # 64 MiB, past the mmap threshold: allocated, touched and freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    torch.ones(16 * 2**20)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
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
    reuse_large_buffers the heap serves them from the first one's pages, and release_freed_memory gives those
    pages back to the OS."""
    fresh, reused = _run("retain"), _run("reuse")
    assert fresh["faults"] > 5 * 10_000, f"fresh mappings faulted only {fresh['faults']}: nothing to compare with"
    assert reused["faults"] * 50 < fresh["faults"], f"{reused['faults']} faults reused vs {fresh['faults']} fresh"
    assert reused["released"]
    assert reused["kept_kib"] - reused["after_kib"] > 48 * 1024, f"released too little: {reused}"
