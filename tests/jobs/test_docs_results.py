"""The library code blocks of docs/results.md run as written, in order of need (compute, then read), and give the
shapes their comments promise. (The client blocks need a server; tests/jobs/test_routes.py covers those calls.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ntk_service.results import ResultView

DOC = Path(__file__).resolve().parents[2] / "docs" / "results.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


@pytest.mark.slow
def test_the_library_blocks_of_docs_results_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = [b for b in _blocks() if "Client(" not in b and "client." not in b]
    compute = [b for b in blocks if "compute_ntk_tiled(" in b]
    reads = [b for b in blocks if b not in compute]
    assert len(compute) == 1 and len(reads) == 2, "docs/results.md: expected one compute block and two read blocks"
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    namespaces: list[dict[str, Any]] = []
    try:
        for number, block in enumerate(compute + reads):
            namespace: dict[str, Any] = {}
            exec(compile(block, f"{DOC}:block{number}", "exec"), namespace)  # noqa: S102 - the docs' own code
            namespaces.append(namespace)
    finally:
        torch.set_num_threads(threads)
    made, read, plain = namespaces
    assert isinstance(made["theta"], ResultView) and made["theta"].shape == (500, 500)
    np.testing.assert_array_equal(np.asarray(made["again"]), np.asarray(made["result"]))
    assert (read["result"].shape, read["result"].dims, read["result"].attrs["x1_rows"]) == (
        (1000, 1000),
        ("x1", "x2"),
        [0, 1000],
    )
    assert isinstance(read["block"], ResultView) and read["theta"].shape == (500, 250)
    whole = read["result"].to_numpy()
    np.testing.assert_array_equal(read["every_10th"], whole[::10, ::10])
    assert read["tail"].shape == (10, 1000) and read["sub"].shape == (3, 2) and read["row_sums"].shape == (1000,)
    np.testing.assert_array_equal(read["sub"], whole[np.ix_([3, 750, 42], [7, 999])])
    assert tuple(plain["g"]["theta"].metadata.dimension_names) == ("x1", "x2")
