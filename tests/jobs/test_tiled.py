"""compute_ntk_tiled and open_result: the dense float64 reference through every slice shape, the format other tools
open, a real ``kill -9`` mid-run resumed to a bitwise-equal result, reads that touch only the slice's chunks."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr
import zarr
from torch import nn

from ntk_service.errors import InvalidInput
from ntk_service.jobs.planner import plan_tiles
from ntk_service.jobs.results import ResultArray
from ntk_service.kernels import KernelMode
from ntk_service.results import FORMAT_VERSION, compute_ntk_tiled, open_result
from tests.jobs.factories import slow_tiled_problem
from tests.reference import reference_ntk

REPO_ROOT = Path(__file__).resolve().parents[2]

SLICES = {
    "above": (slice(0, 4), slice(4, 11)),
    "across": (slice(2, 9), slice(1, 10)),
    "below": (slice(8, 11), slice(0, 3)),
    "ragged last tile": (slice(8, 11), slice(8, 11)),
    "below, ragged columns": (slice(9, 11), slice(5, 11)),
    "steps": (slice(1, None, 3), slice(None, None, 2)),
    "whole": (slice(None), slice(None)),
}
"""x (11, 4), tiles of 4: blocks [0,4) [4,8) [8,11); only blocks on or above the diagonal are stored."""


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(0).standard_normal((11, 4)))


@pytest.mark.parametrize("mode", [KernelMode.FULL, KernelMode.TRACE, KernelMode.OUTPUT_DIAGONAL])
def test_every_slice_equals_the_dense_reference(tmp_path: Path, x: torch.Tensor, mode: KernelMode) -> None:
    model = _model()
    out = tmp_path / "k.zarr"
    view = compute_ntk_tiled(model, x, out=out, mode=mode, tile_size=4, dtype="float64", progress=False)
    dense = reference_ntk(model, x, mode=mode.value).numpy()
    assert view.shape == dense.shape
    for name, (rows, cols) in SLICES.items():
        got = np.asarray(view[rows, cols])
        np.testing.assert_allclose(got, dense[rows, cols], rtol=1e-10, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(view[10, 3], dense[10, 3], rtol=1e-10, atol=1e-12)  # one entry below the diagonal
    whole = view.to_numpy()
    np.testing.assert_array_equal(
        whole, np.swapaxes(whole, 0, 1) if mode is not KernelMode.FULL else whole.transpose(1, 0, 3, 2)
    )  # exactly symmetric
    np.testing.assert_array_equal(view.to_dask().compute(), whole)
    rows, cols = [10, 0, 5, 9], [1, 8, 2]
    picked = view.to_xarray().isel(x1=rows, x2=cols)
    np.testing.assert_array_equal(picked.values, whole[np.ix_(rows, cols)])
    assert picked.dims == view.dims and picked.attrs["format_version"] == FORMAT_VERSION


@pytest.mark.parametrize("mode", [mode for mode in KernelMode if not mode.spec.pairs], ids=str)
def test_per_example_modes(tmp_path: Path, x: torch.Tensor, mode: KernelMode) -> None:
    model = _model()
    view = compute_ntk_tiled(model, x, out=tmp_path / "d.zarr", mode=mode, tile_size=4, dtype="float64", progress=False)
    dense = reference_ntk(model, x, mode=mode.value).numpy()
    assert (
        view.dims
        == {
            "example_diagonal": ("x1", "out1", "out2"),
            "example_trace": ("x1",),
            "example_output_diagonal": ("x1", "out"),
        }[mode.value]
    )
    np.testing.assert_allclose(np.asarray(view[3:10]), dense[3:10], rtol=1e-10, atol=1e-12)


def test_other_tools_open_the_result_and_metadata_says_what_made_it(tmp_path: Path, x: torch.Tensor) -> None:
    model = _model()
    x2 = torch.from_numpy(np.random.default_rng(1).standard_normal((5, 4)))
    out = tmp_path / "k.zarr"
    compute_ntk_tiled(model, x, x2, out=out, mode="full", tile_size=4, dtype="float64", progress=False)
    dataset = xr.open_zarr(out)  # no warning: the metadata is consolidated (warnings are errors here)
    assert dataset["theta"].dims == ("x1", "x2", "out1", "out2") and dataset["theta"].shape == (11, 5, 3, 3)
    np.testing.assert_allclose(
        dataset["theta"].values, reference_ntk(model, x, x2, mode="full").numpy(), rtol=1e-10, atol=1e-12
    )
    group = zarr.open_group(str(out), mode="r")
    attrs = dict(group.attrs)
    assert attrs["format"] == "ntk-service-result" and attrs["format_version"] == FORMAT_VERSION
    assert (attrs["mode"], attrs["dtype"], attrs["tile_size"], attrs["k"], attrs["symmetric"]) == (
        "full",
        "float64",
        4,
        3,
        False,
    )
    assert attrs["x1_rows"] == [0, 11] and attrs["x2_rows"] == [0, 5]
    assert attrs["torch_version"] == torch.__version__.split("+")[0] or attrs["torch_version"] == torch.__version__
    assert attrs["implementation_used"] and len(attrs["weights_sha256"]) == 64


def test_reads_touch_only_the_chunks_of_the_slice_and_its_mirror(tmp_path: Path, x: torch.Tensor) -> None:
    model = _model()
    out = tmp_path / "k.zarr"
    view = compute_ntk_tiled(model, x, out=out, mode="trace", tile_size=4, dtype="float64", progress=False)
    expected = view.to_numpy()
    # Rows [8, 11) x cols [0, 3) (below the diagonal) come from the stored block (0, 2) only: break every other chunk.
    for chunk in (out / "theta" / "c").rglob("*"):
        if chunk.is_file() and chunk.relative_to(out / "theta" / "c").parts != ("0", "2"):
            chunk.write_bytes(b"not a chunk")
    np.testing.assert_array_equal(np.asarray(open_result(out)[8:11, 0:3]), expected[8:11, 0:3])
    with pytest.raises(Exception, match="(?i)size|shape|buffer|decode"):
        np.asarray(open_result(out)[0:4, 0:4])  # a broken chunk does fail when it is read


def test_resume_checks_the_arguments_and_incomplete_results_are_refused(tmp_path: Path, x: torch.Tensor) -> None:
    model = _model()
    out = tmp_path / "k.zarr"
    compute_ntk_tiled(model, x, out=out, mode="trace", tile_size=4, dtype="float64", progress=False)
    with pytest.raises(InvalidInput, match="holds a different computation.*tile_size: stored 4, now 3"):
        compute_ntk_tiled(model, x, out=out, mode="trace", tile_size=3, dtype="float64", progress=False)
    again = compute_ntk_tiled(
        model, x, out=out, mode="trace", tile_size=3, dtype="float64", resume=False, progress=False
    )
    assert again.attrs["tile_size"] == 3
    ledger = next((out / "tiles" / "done" / "c").iterdir())
    ledger.unlink()  # as if the run had been cut off before this tile
    with pytest.raises(InvalidInput, match=r"incomplete \(9/10 tiles written\)"):
        open_result(out)
    assert open_result(out, allow_incomplete=True).shape == (11, 11)
    with pytest.raises(InvalidInput, match="not an ntk-service result|no ntk-service result"):
        open_result(tmp_path)


def test_progress_is_silent_when_stderr_is_not_a_terminal(
    tmp_path: Path, x: torch.Tensor, capfd: pytest.CaptureFixture[str]
) -> None:
    compute_ntk_tiled(_model(), x, out=tmp_path / "k.zarr", mode="trace", tile_size=4, progress=True)
    assert capfd.readouterr().err == ""


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_shows_tiles_rate_and_eta(
    tmp_path: Path, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    compute_ntk_tiled(_model(), x, out=tmp_path / "k.zarr", mode="trace", tile_size=4, progress=True)
    text = terminal.getvalue()
    assert "compute_ntk_tiled" in text and "6/6" in text and "tile/s" in text and "<" in text  # elapsed<ETA


_CHILD = """
import sys, torch
from ntk_service.results import compute_ntk_tiled
from tests.jobs.factories import slow_tiled_problem

torch.set_num_threads(1)
model, x = slow_tiled_problem()
compute_ntk_tiled(
    model, x, out=sys.argv[1], mode="full", tile_size=2, panel_tiles=2, memory_budget_bytes=2**26, progress=False
)
"""


def _run_child(out: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with (out.parent / f"{out.name}.log").open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(out)], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )


def _chunk_files(out: Path) -> dict[str, tuple[int, int]]:
    """Every chunk and ledger file with (inode, mtime): a rewritten file (os.replace) gets a new inode."""
    files = {}
    for path in out.rglob("*"):
        if path.is_file() and "c" in path.relative_to(out).parts:
            stat = path.stat()
            files[str(path.relative_to(out))] = (stat.st_ino, stat.st_mtime_ns)
    return files


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_is_bitwise_equal_and_recomputes_no_done_tile(tmp_path: Path) -> None:
    interrupted, fresh = tmp_path / "interrupted.zarr", tmp_path / "fresh.zarr"
    child = _run_child(interrupted)
    deadline = time.monotonic() + 120
    ledger = interrupted / "tiles" / "done" / "c"
    while not (ledger.exists() and len(list(ledger.iterdir())) >= 3):
        assert child.poll() is None, (tmp_path / "interrupted.zarr.log").read_text()
        assert time.monotonic() < deadline, "the child wrote no 3 tiles in 120 s"
        time.sleep(0.02)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(10)
    done_before = {int(p.name) for p in ledger.iterdir()}
    files_before = _chunk_files(interrupted)
    assert 3 <= len(done_before) < 21, done_before  # 6 row blocks: 21 tiles on or above the diagonal
    with pytest.raises(InvalidInput, match="incomplete"):
        open_result(interrupted)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the child: float32 sums depend on the thread count
    try:
        model, x = slow_tiled_problem()
        options = {"mode": "full", "tile_size": 2, "memory_budget_bytes": 2**26, "progress": False}
        resumed = compute_ntk_tiled(model, x, out=interrupted, **options)  # type: ignore[arg-type]
        uninterrupted = compute_ntk_tiled(model, x, out=fresh, panel_tiles=2, **options)  # type: ignore[arg-type]
    finally:
        torch.set_num_threads(threads)
    files_after = _chunk_files(interrupted)
    untouched = {name for name, stat in files_before.items() if files_after.get(name) == stat}
    # Every tile that was done before the kill kept its chunk file and ledger entry as they were: not recomputed.
    for tile_id in done_before:
        i, j = divmod(tile_id, 6)
        assert {f"tiles/done/c/{tile_id}", f"theta/c/{i}/{j}/0/0"} <= untouched, tile_id
    np.testing.assert_array_equal(resumed.to_numpy(), uninterrupted.to_numpy())
    reference = reference_ntk(model, x, mode="full").numpy()  # float64 loop: the numbers are right, too
    np.testing.assert_allclose(resumed.to_numpy(), reference, rtol=1e-4, atol=1e-6)
    meta = json.loads((interrupted / "zarr.json").read_text())["attributes"]
    assert meta["tiles_total"] == 21 and meta["symmetric"] is True


def test_resume_false_never_deletes_a_folder_that_is_not_its_result(tmp_path: Path, x: torch.Tensor) -> None:
    model = _model()
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("keep me")
    with pytest.raises(InvalidInput, match="not a result of compute_ntk_tiled; resume=False would delete"):
        compute_ntk_tiled(model, x, out=project, mode="trace", tile_size=4, resume=False, progress=False)
    assert (project / "notes.txt").read_text() == "keep me"
    # A server job's result is an ntk-service result, but not this call's to overwrite or resume into.
    job_result = tmp_path / "jobs" / "abc" / "result.zarr"
    ResultArray.create(
        job_result,
        plan=plan_tiles(n=11, m=None, tile_size=4, mode=KernelMode.TRACE),
        k=3,
        dtype="float32",
        attributes={"job_id": "abc"},
    )
    for resume in (True, False):
        with pytest.raises(InvalidInput, match="is the result of the server's job abc"):
            compute_ntk_tiled(model, x, out=job_result, mode="trace", tile_size=4, resume=resume, progress=False)
    assert (job_result / "zarr.json").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    view = compute_ntk_tiled(model, x, out=empty, mode="trace", tile_size=4, dtype="float64", progress=False)
    np.testing.assert_allclose(np.asarray(view), reference_ntk(model, x, mode="trace").numpy(), rtol=1e-10)


def test_a_result_whose_creation_was_cut_off_is_created_anew(tmp_path: Path, x: torch.Tensor) -> None:
    model = _model()
    out = tmp_path / "k.zarr"
    compute_ntk_tiled(model, x, out=out, mode="trace", tile_size=4, dtype="float64", progress=False)
    # As if killed inside ResultArray.create: the group's attributes written, the ledger (and the consolidated
    # metadata, written last) not yet.
    shutil.rmtree(out / "tiles")
    metadata = json.loads((out / "zarr.json").read_text())
    metadata.pop("consolidated_metadata", None)
    (out / "zarr.json").write_text(json.dumps(metadata))
    with pytest.raises(InvalidInput, match="never fully created"):
        open_result(out)
    view = compute_ntk_tiled(model, x, out=out, mode="trace", tile_size=4, dtype="float64", progress=False)
    np.testing.assert_allclose(np.asarray(view), reference_ntk(model, x, mode="trace").numpy(), rtol=1e-10)


class _Tokens(nn.Module):
    """Keyword inputs (ids, an integer mask) and a dict output, for the mapping path."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lin = nn.Embedding(9, 4), nn.Linear(4, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.lin(torch.tanh(self.emb(input_ids)) * attention_mask.unsqueeze(-1))}


@pytest.mark.parametrize("mode", [KernelMode.FULL, KernelMode.TRACE])
def test_mapping_inputs_and_output_path(tmp_path: Path, mode: KernelMode) -> None:
    torch.manual_seed(1)
    model = _Tokens().double()
    g = torch.Generator().manual_seed(2)
    x1 = {"input_ids": torch.randint(0, 9, (7, 3), generator=g), "attention_mask": torch.ones(7, 3, dtype=torch.int64)}
    x2 = {"input_ids": torch.randint(0, 9, (5, 3), generator=g), "attention_mask": torch.ones(5, 3, dtype=torch.int64)}
    for side2 in (None, x2):
        out = tmp_path / f"k{side2 is None}.zarr"
        kwargs = {"out": out, "mode": mode, "tile_size": 3, "dtype": "float64", "progress": False}
        view = compute_ntk_tiled(model, x1, side2, output="logits[:, 1]", **kwargs)
        dense = reference_ntk(model, x1, side2, mode=mode.value, output=lambda o: o["logits"][:, 1]).numpy()
        np.testing.assert_allclose(view.to_numpy(), dense, rtol=1e-10, atol=1e-12)
        assert dict(zarr.open_group(str(out), mode="r").attrs)["spec"]["kernel"]["output"] == "logits[:, 1]"
        with pytest.raises(InvalidInput, match="holds a different computation.*output"):
            compute_ntk_tiled(model, x1, side2, output="logits[:, 2]", **kwargs)  # resume checks the path too


def test_a_chunk_cut_off_mid_write_reads_as_zero_until_resume_rewrites_it(tmp_path: Path, x: torch.Tensor) -> None:
    # NOTE [raw chunk writes]: chunks are written in place, so a kill mid-write can leave a short chunk whose tile
    # is not in the ledger. An incomplete read must not decode it, and resume must recompute and rewrite it.
    model = _model()
    out = tmp_path / "k.zarr"
    options = {"mode": "trace", "tile_size": 4, "dtype": "float64", "progress": False}
    compute_ntk_tiled(model, x, out=out, **options)  # type: ignore[arg-type]
    tile = next(t for t in plan_tiles(n=11, m=None, tile_size=4, mode=KernelMode.TRACE).tiles if (t.i, t.j) == (0, 1))
    chunk = out / "theta" / "c" / "0" / "1"
    full_size = chunk.stat().st_size
    chunk.write_bytes(chunk.read_bytes()[: full_size // 3])  # cut off mid-write
    (out / "tiles" / "done" / "c" / str(tile.id)).unlink()  # so its ledger entry was never written
    reference = reference_ntk(model, x, mode="trace").numpy()
    partial = np.asarray(open_result(out, allow_incomplete=True)[...])
    expected = reference.copy()
    expected[0:4, 4:8] = expected[4:8, 0:4] = 0  # the tile and its mirror read as 0
    np.testing.assert_allclose(partial, expected, rtol=1e-10, atol=1e-12)
    assert (partial[0:4, 4:8] == 0).all() and (partial[4:8, 0:4] == 0).all()
    resumed = compute_ntk_tiled(model, x, out=out, **options)  # type: ignore[arg-type]
    assert chunk.stat().st_size == full_size
    np.testing.assert_allclose(resumed.to_numpy(), reference, rtol=1e-10, atol=1e-12)
