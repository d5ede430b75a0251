"""Plain slices of a stored result's example axes stay lazy (a ResultView), as docs/results.md promises."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ntk_service.jobs.view import ResultView
from ntk_service.kernels import compute_ntk
from ntk_service.results import compute_ntk_tiled, open_result


def test_plain_slices_are_lazy_and_steps_or_integers_read_now(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    x = torch.randn(11, 3)
    compute_ntk_tiled(model, x, out=tmp_path / "k.zarr", mode="trace", tile_size=4, progress=False)
    result = open_result(tmp_path / "k.zarr")
    expected = compute_ntk(model, x, mode="trace").theta
    block = result[2:9, 1:6]
    assert isinstance(block, ResultView) and block.shape == (7, 5)
    assert isinstance(result[2:9], ResultView)
    np.testing.assert_allclose(np.asarray(block), np.asarray(expected)[2:9, 1:6], rtol=1e-5, atol=1e-6)
    assert isinstance(result[0:9:2, 1:6], np.ndarray)
    np.testing.assert_allclose(result[0:9:2, 1:6], np.asarray(expected)[0:9:2, 1:6], rtol=1e-5, atol=1e-6)
    assert isinstance(result[5, 1:6], np.ndarray) and result[5, 1:6].shape == (5,)
