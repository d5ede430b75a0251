"""dataset_operator over a real .npy memmap read in chunks: its products equal the in-memory ntk_operator's and the
dense float64 reference kernel's, and no read is larger than the chunk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from ntk_service.errors import InvalidInput, NonFiniteInput, ShapeMismatch, UnknownMode
from ntk_service.kernels import dataset_operator, ntk_operator
from tests.reference import reference_ntk


class _ReadLog:
    """A real memmap, with the size of every read noted (what the test checks; the reads themselves are real)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array, self.shape, self.reads = array, array.shape, []

    def __getitem__(self, rows: slice) -> np.ndarray:
        out = self.array[rows]
        self.reads.append(out.shape[0])
        return out


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 12), nn.Tanh(), nn.Linear(12, 3)).double()


def _memmap(tmp_path: Path, name: str, n: int, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).standard_normal((n, 4))
    array = np.lib.format.open_memmap(tmp_path / name, mode="w+", dtype=np.float64, shape=data.shape)
    array[:] = data
    array.flush()
    return np.lib.format.open_memmap(tmp_path / name, mode="r")


@pytest.mark.parametrize("mode", ["full", "trace"])
def test_the_data_set_operator_equals_the_in_memory_one(tmp_path: Path, mode: str) -> None:
    model = _mlp()
    x1 = _ReadLog(_memmap(tmp_path, "x1.npy", 23, 1))
    x2 = _ReadLog(_memmap(tmp_path, "x2.npy", 17, 2))
    streamed = dataset_operator(model, x1, x2, mode=mode, examples_per_chunk=5)
    memory = ntk_operator(model, torch.from_numpy(np.array(x1.array)), torch.from_numpy(np.array(x2.array)), mode=mode)
    assert streamed.shape == memory.shape and streamed.examples_per_chunk == 5
    g = torch.Generator().manual_seed(3)
    v = (
        torch.randn(17, 3, generator=g, dtype=torch.float64)
        if mode == "full"
        else torch.randn(17, generator=g, dtype=torch.float64)
    )
    x1.reads.clear()
    x2.reads.clear()
    got = streamed.matvec(v)
    torch.testing.assert_close(got, memory.matvec(v), rtol=1e-12, atol=1e-12)
    dense = reference_ntk(model, torch.from_numpy(np.array(x1.array)), torch.from_numpy(np.array(x2.array)), mode)
    expected = torch.einsum("nmab,mb->na", dense, v) if mode == "full" else dense @ v
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert max(x1.reads + x2.reads) <= 5 and sum(x2.reads) >= 17 and sum(x1.reads) >= 23  # every row, in chunks
    w = torch.randn(*((23, 3) if mode == "full" else (23,)), generator=g, dtype=torch.float64)
    torch.testing.assert_close(streamed.rmatvec(w), memory.rmatvec(w), rtol=1e-12, atol=1e-12)


def test_symmetric_and_bad_sources(tmp_path: Path) -> None:
    model = _mlp()
    x = _memmap(tmp_path, "x.npy", 9, 4)
    op = dataset_operator(model, x, examples_per_chunk=4)
    assert op.is_symmetric and op.shape == (27, 27)
    dense = reference_ntk(model, torch.from_numpy(np.array(x)))
    v = torch.ones(9, 3, dtype=torch.float64)
    torch.testing.assert_close(op.matvec(v), torch.einsum("nmab,mb->na", dense, v), rtol=1e-10, atol=1e-12)
    with pytest.raises(InvalidInput, match="sliceable array"):
        dataset_operator(model, x, object())
    with pytest.raises(ShapeMismatch, match="per-example shape"):
        dataset_operator(model, x, np.zeros((3, 5)))
    with pytest.raises(UnknownMode):
        dataset_operator(model, x, mode="example_diagonal")
    with pytest.raises(InvalidInput, match="examples_per_chunk"):
        dataset_operator(model, x, examples_per_chunk=0)
    bad = np.array(x)
    bad[7, 1] = np.nan  # in a later chunk: found when that chunk is read
    with pytest.raises(NonFiniteInput):
        dataset_operator(model, bad, examples_per_chunk=4).matvec(v)
