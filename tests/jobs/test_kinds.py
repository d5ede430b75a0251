"""The solve and features kinds in one lifecycle (JobManager, local executor, a real registry and data sets): every
unit of work goes through the manager's compute slot, and a job stopped mid-run goes on at the next start from what
it recorded (a solve from its last checkpoint, features from its chunks) to the bits of an uninterrupted run, never
computing a recorded unit again. The kernel kind's own tests are test_manager.py and test_routes.py."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ntk_service.errors import InvalidInput
from ntk_service.jobs import JOB_KINDS, JobKind, JobManager, JobRecord, JobStatus
from ntk_service.jobs.kinds.base import JobStopped, Layout, PlanContext, RunContext
from ntk_service.jobs.kinds.features import FeaturesRequest, read_features
from ntk_service.jobs.kinds.rows import DataRows
from ntk_service.jobs.kinds.solve import SolveRequest, SolveSpec, read_solution
from ntk_service.jobs.solve_job import SolveOptions, SolveProgress, SolveReport
from ntk_service.kernels.modes import KernelMode
from tests.jobs.conftest import JobsEnv, wait_finished


class _Slots:
    """A run_compute that counts its calls; with ``free``, it blocks the call after ``free`` until ``go``. With
    ``watch`` (a folder), it notes how many calls had run when a solve's checkpoint (``state.npz``) last changed."""

    def __init__(self, free: int | None = None, watch: Path | None = None) -> None:
        self.free, self.calls, self.watch = free, 0, watch
        self.blocked, self.go = threading.Event(), threading.Event()
        self.seen: tuple[int, int] | None = None
        self.at_checkpoint = 0

    def __call__(self, fn: Callable[[], Any]) -> Any:
        if self.watch is not None:  # the run writes a checkpoint between two calls, in this thread
            for path in self.watch.glob("**/solve/*/state.npz"):
                stat = path.stat()
                if (stat.st_mtime_ns, stat.st_ino) != self.seen:
                    self.seen, self.at_checkpoint = (stat.st_mtime_ns, stat.st_ino), self.calls
        self.calls += 1
        if self.free is not None and self.calls > self.free:
            self.blocked.set()
            self.go.wait(30)
        return fn()


def _stop_at_the_gate(manager: JobManager, slots: _Slots) -> None:
    """Stop ``manager`` while a unit waits at the gate: the unit finishes, no further one starts."""
    assert slots.blocked.wait(60)
    stopper = threading.Thread(target=manager.stop)
    stopper.start()
    slots.go.set()
    stopper.join(60)
    assert not stopper.is_alive()


@pytest.fixture
def targets(jobs_env: JobsEnv) -> str:
    """y (11, 3) float64 for jobs_env's x1."""
    return jobs_env.datasets.create(np.random.default_rng(5).standard_normal((11, 3))).id


@pytest.mark.parametrize(
    ("solver", "settings"),
    [("pcg", {"progress_every": 3, "preconditioner": "none"}), ("block", {"block_size": 4, "landmarks": 2})],
)
def test_a_stopped_solve_goes_on_from_its_last_checkpoint_to_the_bits_of_an_uninterrupted_run(
    jobs_env: JobsEnv, make_manager: Callable[..., JobManager], targets: str, solver: str, settings: dict[str, Any]
) -> None:
    """NOTE [solve resume]: stopped while a unit waits, the job resumes at the next start from its last checkpoint
    (CG's restart every 3 iterations; the block method's epoch) to the bits of an uninterrupted run, computing
    exactly the calls the uninterrupted run made after that checkpoint: none recorded is computed again."""
    request = SolveRequest(
        kind="kernel_ridge", model="tiny", train=DataRows(jobs_env.x1_id), targets=DataRows(targets),
        test=DataRows(jobs_env.x2_id), ridge=1.0, rtol=1e-6, solver=solver, **settings,
    )  # fmt: skip
    gate = _Slots(free=40, watch=jobs_env.data_dir)  # past two checkpoints of either method, far from the end
    first = make_manager(run_compute=gate)
    job = first.create(request)
    _stop_at_the_gate(first, gate)
    stopped = first.get(job.id)
    assert stopped.status is JobStatus.RUNNING and isinstance(stopped.checkpoint, SolveProgress)
    assert stopped.checkpoint.solver == solver and (first.folder(stopped) / "state.npz").is_file()
    if solver == "pcg":
        assert stopped.checkpoint.iterations >= 3 and stopped.checkpoint.iterations % 3 == 0  # a restart
    else:
        assert stopped.checkpoint.epochs >= 1
    before_checkpoint = gate.at_checkpoint

    counted = _Slots()
    second = make_manager(run_compute=counted)  # the next start
    resumed = wait_finished(second, job.id)
    assert resumed.status is JobStatus.SUCCEEDED, resumed.error
    on_resume = counted.calls
    fresh = wait_finished(second, second.create(request).id)
    whole_calls = counted.calls - on_resume
    report, whole = resumed.result, fresh.result
    assert isinstance(report, SolveReport) and isinstance(whole, SolveReport)
    assert report.converged and report.solver == whole.solver == solver
    assert (report.iterations, report.epochs, report.passes) == (whole.iterations, whole.epochs, whole.passes)
    assert on_resume == whole_calls - before_checkpoint  # what the stop left, not one call more
    for mine, theirs in zip(read_solution(second.folder(resumed)), read_solution(second.folder(fresh)), strict=True):
        assert mine is not None and theirs is not None
        np.testing.assert_array_equal(mine, theirs)
    assert not (second.folder(resumed) / "state.npz").exists()  # the state goes once the arrays are recorded


def test_a_stopped_features_job_computes_only_the_chunks_it_lacks(
    jobs_env: JobsEnv, make_manager: Callable[..., JobManager]
) -> None:
    request = FeaturesRequest(model="tiny", dataset=DataRows(jobs_env.x1_id), dim=16, seed=3, dtype="float64",
                              rows_per_chunk=2)  # fmt: skip
    gate = _Slots(free=2)  # 6 chunks: 2 pass, the third waits at the gate and is recorded once let through
    first = make_manager(run_compute=gate)
    job = first.create(request)
    _stop_at_the_gate(first, gate)
    stopped = first.get(job.id)
    assert stopped.status is JobStatus.RUNNING and (stopped.tiles_done, stopped.tiles_total) == (3, 6)
    assert stopped.checkpoint is not None and stopped.checkpoint.to_json() == {"rows_done": 6, "rows_total": 11}

    counted = _Slots()
    second = make_manager(run_compute=counted)
    resumed = wait_finished(second, job.id)
    assert resumed.status is JobStatus.SUCCEEDED and counted.calls == 3  # the three chunks it lacked
    assert set(second.store.tile_attempts(job.id).values()) == {1}  # no chunk computed twice
    fresh = wait_finished(second, second.create(request).id)
    np.testing.assert_array_equal(
        np.asarray(read_features(second.folder(resumed))[:]), np.asarray(read_features(second.folder(fresh))[:])
    )
    assert resumed.result is not None and resumed.result.to_json() == {"shape": [11, 3, 16], "seed": 3, "dim": 16}


def test_values_are_stored_typed_and_read_back_in_the_form_of_every_version() -> None:
    solve = JOB_KINDS["solve"]
    spec = SolveSpec(
        model="m", version=1, train_dataset="a", train_start=0, n=4, targets_dataset="b", targets_start=0,
        test_dataset=None, test_start=0, m=0, k=2, options=SolveOptions(kind="gp_mean", mode="trace", params=["l.*"]),
    )  # fmt: skip
    stored = solve.encode_spec(spec)
    assert stored["kind"] == "gp_mean" and stored["mode"] == "trace" and stored["params"] == ["l.*"]
    back = solve.decode_spec(stored)
    assert back == spec and back.options.mode is KernelMode.TRACE and back.options.params == ("l.*",)
    # a progress of an earlier version (fewer fields) and of a later one (more) both read
    assert solve.decode_progress({"iterations": 3}) == SolveProgress(iterations=3)
    assert solve.decode_progress({"iterations": 3, "steps": 9}) == SolveProgress(iterations=3)
    with pytest.raises(InvalidInput, match="unknown kind 'lasso'"):
        SolveOptions(kind="lasso")


# -- a kind defined here, outside the package: one module's worth of code and a row in the manager's table --------


@dataclass(frozen=True)
class _SumRequest:
    dataset: str


@dataclass(frozen=True)
class _SumSpec:
    dataset: str
    n: int

    def to_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "n": self.n}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> _SumSpec:
        return cls(**data)


@dataclass(frozen=True)
class _SumValue:
    value: float

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> _SumValue:
        return cls(**data)


class _RowSums(JobKind[_SumRequest, _SumSpec, _SumValue, _SumValue]):
    """The sum of a data set's rows, two rows a tile: each tile's sum written to its own file, then the total."""

    name, noun, operation, route, folder = "row-sums", "row-sums job", "row sums", "/v1/row-sums", "row-sums"
    request_type, spec_type, progress_type, result_type = _SumRequest, _SumSpec, _SumValue, _SumValue

    def layout(self, spec: _SumSpec) -> Layout:
        tiles = tuple(range(-(-spec.n // 2)))
        return Layout(tile_ids=tiles, result_shape=(len(tiles),), estimate_bytes=8 * len(tiles), what="sums", fix="")

    def plan(self, request: _SumRequest, ctx: PlanContext) -> _SumSpec:
        return _SumSpec(request.dataset, int(ctx.datasets.get(request.dataset).shape[0]))

    def run(self, job: JobRecord[_SumSpec, _SumValue, _SumValue], ctx: RunContext[_SumValue]) -> _SumValue:
        rows = np.asarray(ctx.datasets.load(job.spec.dataset), dtype=np.float64)
        for tile in ctx.pending():
            if ctx.should_stop():
                raise JobStopped
            if ctx.claim([tile]):
                total = ctx.run_compute(lambda tile=tile: float(rows[2 * tile : 2 * tile + 2].sum()))
                np.save(ctx.folder / f"{tile}.npy", total)
                ctx.done([tile], elapsed_s=0.0)
                ctx.checkpoint(_SumValue(float(min(2 * tile + 2, job.spec.n))))  # rows summed: tiles go in order
        return _SumValue(sum(float(np.load(path)) for path in ctx.folder.glob("*.npy")))


def test_a_kind_defined_outside_the_package_runs_through_the_one_lifecycle(
    jobs_env: JobsEnv, make_manager: Callable[..., JobManager]
) -> None:
    gate = _Slots(free=2)  # 6 tiles of x1's 11 rows: 2 pass, the third waits at the gate
    kinds = {**JOB_KINDS, "row-sums": _RowSums()}
    first = make_manager(run_compute=gate, kinds=kinds)
    job = first.create(_SumRequest(jobs_env.x1_id))
    _stop_at_the_gate(first, gate)
    stopped = first.get(job.id)
    assert (stopped.tiles_done, stopped.checkpoint) == (3, _SumValue(6.0))  # typed, through the store
    assert first.list(kinds["row-sums"]) == [stopped] and first.list(JOB_KINDS["solve"]) == []
    counted = _Slots()
    second = make_manager(run_compute=counted, kinds=kinds)
    done = wait_finished(second, job.id)
    assert done.status is JobStatus.SUCCEEDED and counted.calls == 3  # the tiles it lacked, none again
    assert done.result == _SumValue(pytest.approx(float(jobs_env.x1.astype(np.float64).sum())))
    assert second.delete(job.id).freed_bytes > 0 and not second.folder(done).exists()
