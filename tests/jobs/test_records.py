"""A kernel job's spec holds the engine's values (a KernelSpec, an NtkOptions), stores their JSON, and reads the
flat form of earlier versions to the same value."""

from __future__ import annotations

import json
import pickle
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ntk_service.errors import InvalidInput, UnknownMode
from ntk_service.jobs.records import JobRecord, JobSpec, JobStatus
from ntk_service.jobs.store import JobStore
from ntk_service.kernels import KernelSpec, NtkOptions
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.types import NtkImplementation

_WHERE: dict[str, Any] = {
    "model": "m",
    "version": 2,
    "weights_sha256": "w",
    "x1_dataset": "ds_a",
    "x2_dataset": "ds_b",
    "x1_sha256": "a",
    "x2_sha256": "b",
    "n": 10,
    "m": 7,
    "k": 3,
    "tile_size": 4,
}

FLAT_V1 = {
    **_WHERE,
    "mode": "output_diagonal",
    "implementation": "jacobian_contraction",
    "dtype": "float64",
    "params": ["head.*"],
    "memory_budget_bytes": 2**20,
    "x1_start": 5,
    "x2_start": 1,
    "output": "logits[:, 0]",
    "panel_tiles": 2,
}
"""A kernel job spec as every version before this one stored it (``asdict`` with the enums' wire values)."""


def _spec() -> JobSpec:
    return JobSpec(
        **_WHERE,
        kernel=KernelSpec(mode="output_diagonal", params=["head.*"], output="logits[:, 0]"),
        options=NtkOptions(implementation="jacobian_contraction", dtype="float64", memory_budget_bytes=2**20),
        x1_start=5,
        x2_start=1,
        panel_tiles=2,
    )


def test_the_spec_holds_the_engine_values_and_reads_them_back_as_before() -> None:
    spec = _spec()
    assert isinstance(spec.kernel, KernelSpec) and isinstance(spec.options, NtkOptions)
    assert spec.kernel.output_path is not None  # parsed once, when the job was built
    assert (spec.mode, spec.implementation, spec.dtype) == (
        KernelMode.OUTPUT_DIAGONAL,
        NtkImplementation.JACOBIAN_CONTRACTION,
        "float64",
    )
    assert (spec.params, spec.output, spec.memory_budget_bytes) == (("head.*",), "logits[:, 0]", 2**20)
    assert spec.options.dtype is torch.float64
    assert spec.engine_options() is spec.options  # where the model is: the stored value itself, nothing rebuilt
    on_cpu = spec.engine_options(device="cpu")
    assert on_cpu.device == torch.device("cpu") and on_cpu.replace(device=None) == spec.options


def test_the_stored_form_is_the_values_json_and_round_trips() -> None:
    spec = _spec()
    data = spec.to_dict()
    assert data["kernel"] == spec.kernel.to_json() and data["options"] == spec.options.to_json()
    assert not {"mode", "implementation", "dtype", "params", "output", "memory_budget_bytes"} & set(data)
    again = JobSpec.from_dict(json.loads(json.dumps(data)))
    assert again == spec and hash(again) == hash(spec)
    assert pickle.loads(pickle.dumps(spec)) == spec  # shipped to Ray workers in JobWork


def test_the_flat_form_of_earlier_versions_reads_to_the_same_value() -> None:
    assert JobSpec.from_dict(FLAT_V1) == _spec()
    oldest = {key: value for key, value in FLAT_V1.items() if key not in ("output", "panel_tiles", "x1_start")}
    old = JobSpec.from_dict({**oldest, "x2_start": 0})  # before outputs, panels and row ranges
    assert (old.output, old.panel_tiles, old.x1_start) == (None, 1, 0)
    # the loose keywords of the constructor still build the same value
    assert JobSpec(**FLAT_V1) == _spec()


def test_a_store_writes_the_new_form_and_reads_a_row_an_earlier_version_wrote(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    record: JobRecord[JobSpec, None, None] = JobRecord(
        id="j1", spec=_spec(), status=JobStatus.QUEUED, tiles_done=0, tiles_total=1, created_at=time.time(),
        started_at=None, finished_at=None, error=None, implementation_used=None, executor="local",
    )  # fmt: skip
    store.create_job(record, tile_ids=[0])
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as conn:
        (stored,) = conn.execute("SELECT spec FROM jobs WHERE id = 'j1'").fetchone()
        assert json.loads(stored)["kernel"]["mode"] == "output_diagonal"
        conn.execute("UPDATE jobs SET spec = ? WHERE id = 'j1'", (json.dumps(FLAT_V1),))
    assert store.get_job("j1").spec == _spec()


@pytest.mark.parametrize(
    ("changes", "error", "words"),
    [
        ({"mode": "pseudo"}, UnknownMode, "derived mode"),
        ({"mode": "diagonal"}, UnknownMode, "unknown mode"),
        ({"dtype": "float16"}, InvalidInput, "float16"),
        ({"implementation": "fastest"}, InvalidInput, "fastest"),
        ({"params": []}, InvalidInput, "selects nothing"),
        ({"output": "logits[:"}, InvalidInput, "output"),
    ],
)
def test_a_bad_stored_value_is_refused_naming_it(changes: dict[str, Any], error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        JobSpec.from_dict({**FLAT_V1, **changes})


def test_what_a_job_cannot_hold_is_refused() -> None:
    with pytest.raises(InvalidInput, match="together with options"):
        JobSpec(**_WHERE, options=NtkOptions(dtype="float32"), dtype="float64")
    with pytest.raises(InvalidInput, match="together with kernel="):
        JobSpec(**_WHERE, kernel=KernelSpec(mode="trace"), mode="full")
    with pytest.raises(InvalidInput, match="no device"):
        JobSpec(**_WHERE, options=NtkOptions(device="cpu"))
    with pytest.raises(InvalidInput, match="compute_ntk_groups"):
        JobSpec(**_WHERE, kernel=KernelSpec(groups="modules"))
    with pytest.raises(InvalidInput, match="unknown fields"):
        JobSpec.from_dict({**FLAT_V1, "colour": "red"})
    assert JobSpec(**_WHERE, options=NtkOptions()).dtype == "float32"  # a job always names its dtype
