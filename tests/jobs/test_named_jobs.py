"""Jobs over data sets of named arrays (``input_ids`` and ``attention_mask``): the stored kernel equals the float64
reference loop on the same mapping, on the local and the Ray executor; ``output=`` picks from a mapping the model
returns; bad sides are refused at submission (422 over HTTP) naming the array."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from torch import nn

from ntk_service.client import Client
from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.jobs import JobManager, JobStatus, LocalExecutor
from ntk_service.jobs.executors import RayExecutor
from ntk_service.registry import DatasetStore, ModelRegistry
from tests.conftest import LiveServer
from tests.jobs.conftest import wait_finished
from tests.jobs.token_models import TOKEN_FACTORY, VOCAB, build, token_inputs
from tests.reference import assert_matches, reference_ntk

TOKEN_MODEL = {
    "family": "factory",
    "factory": TOKEN_FACTORY,
    "kwargs": {"dim": 4, "k": 2},
    "input_shape": [5],
    "input_dtype": "int64",
}
"""Registered through the registry's factory path; its probe calls forward(input_ids) alone (the mask is optional)."""


def _numpy(batch: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: t.numpy() for name, t in batch.items()}


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[ModelRegistry, DatasetStore]]:
    registry = ModelRegistry(tmp_path, allowed_factories=frozenset({TOKEN_FACTORY}))
    datasets = DatasetStore(tmp_path)
    registry.register("tokens", TOKEN_MODEL, seed=3)
    yield registry, datasets
    registry.close()
    datasets.close()


def _manager(tmp_path: Path, models: Any, datasets: DatasetStore, executor: Any = None) -> JobManager:
    manager = JobManager(
        data_dir=tmp_path,
        models=models,
        datasets=datasets,
        executor=executor or LocalExecutor(),
        memory_budget_bytes=64 * 2**20,
    )
    manager.start()
    return manager


def _run(manager: JobManager, **options: Any) -> np.ndarray:
    record = wait_finished(manager, manager.submit(**options).id, timeout=120)
    assert record.status is JobStatus.SUCCEEDED, record.error
    return manager.read_result(record.id)


def test_a_job_over_named_arrays_equals_the_reference(tmp_path: Path, env: tuple[ModelRegistry, DatasetStore]) -> None:
    registry, datasets = env
    x1, x2 = token_inputs(7, seed=0), token_inputs(5, seed=1)
    id1, id2 = datasets.create(_numpy(x1)).id, datasets.create(_numpy(x2)).id
    _, model = registry.load_module("tokens")
    manager = _manager(tmp_path, registry, datasets)
    try:
        full = _run(manager, model="tokens", x1_dataset=id1, x2_dataset=id2, dtype="float64", tile_size=3)
        assert_matches(torch.from_numpy(full), reference_ntk(model, x1, x2))
        rows = _run(manager, model="tokens", x1_dataset=id1, x1_rows=(2, 6), mode="trace", dtype="float64", tile_size=2)
        part = {name: t[2:6] for name, t in x1.items()}
        assert_matches(torch.from_numpy(rows), reference_ntk(model, part, mode="trace"))
        # The mask matters: the same ids without it give another kernel (the test would not notice a dropped leaf).
        unmasked = reference_ntk(model, {"input_ids": x1["input_ids"]}, {"input_ids": x2["input_ids"]})
        assert not torch.allclose(torch.from_numpy(full), unmasked, rtol=1e-3)
    finally:
        manager.stop()


class _Modules:
    """The manager's ModelSource over one in-process module (a model returning a mapping cannot be registered
    until model records carry input specs: the registry probes forward for one tensor)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module.eval()

    def load_module(self, name: str, version: int | None = None) -> tuple[Any, nn.Module]:
        record = type("Record", (), {"name": name, "version": 1, "weights_sha256": "0" * 64, "output_dim": 999})
        return record, self.module


def test_output_selects_from_a_mapping(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build(dim=3, k=2, mapping_output=True)
    datasets = DatasetStore(tmp_path)
    x = token_inputs(5, seed=2)
    dataset_id = datasets.create(_numpy(x)).id
    manager = _manager(tmp_path, _Modules(model), datasets)
    try:
        logits = _run(manager, model="m", x1_dataset=dataset_id, output="logits", dtype="float64", tile_size=2)
        assert logits.shape == (5, 5, 2, 2)  # k from the selection (2), not the record's output_dim
        assert_matches(torch.from_numpy(logits), reference_ntk(model, x, output=lambda out: out["logits"]))
        first = _run(manager, model="m", x1_dataset=dataset_id, output="hidden[:, 0]", mode="trace", dtype="float64")
        expected = reference_ntk(model, x, mode="trace", output=lambda out: out["hidden"][:, 0])
        assert_matches(torch.from_numpy(first), expected)
        with pytest.raises(InvalidInput, match="logit"):
            manager.submit(model="m", x1_dataset=dataset_id, output="logit")
    finally:
        manager.stop()
        datasets.close()


def test_bad_sides_are_refused_at_submission(tmp_path: Path, env: tuple[ModelRegistry, DatasetStore]) -> None:
    registry, datasets = env
    good = token_inputs(6, seed=0)
    ok = datasets.create(_numpy(good)).id
    manager = _manager(tmp_path, registry, datasets)
    submit = {"model": "tokens", "x1_dataset": ok}
    try:
        renamed = datasets.create({"input_ids": good["input_ids"].numpy(), "mask": good["attention_mask"].numpy()})
        with pytest.raises(InvalidInput, match=r"missing \['attention_mask'\], extra \['mask'\]"):
            manager.submit(**submit, x2_dataset=renamed.id)
        longer = datasets.create(_numpy(token_inputs(6, t=7)))
        with pytest.raises(ShapeMismatch, match=r"x2\['input_ids'\] has per-example shape \(7,\)"):
            manager.submit(**submit, x2_dataset=longer.id)
        single = datasets.create(good["input_ids"].numpy())
        with pytest.raises(InvalidInput, match="holds named arrays but"):
            manager.submit(**submit, x2_dataset=single.id)
        floats = datasets.create({"input_ids": good["input_ids"].numpy().astype(np.float64)})
        with pytest.raises(InvalidInput, match=r"\['input_ids'\].*feeds the nn.Embedding 'embed'"):
            manager.submit(model="tokens", x1_dataset=floats.id)
        extra = datasets.create({**_numpy(good), "token_type_ids": np.zeros((6, 5), np.int64)})
        with pytest.raises(InvalidInput, match="token_type_ids"):
            manager.submit(model="tokens", x1_dataset=extra.id)
        with pytest.raises(InvalidInput, match="rows"):
            manager.submit(**submit, x1_rows=(4, 9))
        # Ids beyond the vocabulary in a late row (the probe sees only row 0): every row is checked, in chunks.
        ids = good["input_ids"].numpy().copy()
        ids[5, 3] = VOCAB
        late = datasets.create({"input_ids": ids, "attention_mask": good["attention_mask"].numpy()})
        message = (
            rf"jobs: x2\['input_ids'\] \(data set '{late.id}'\) has token id {VOCAB} in row 5, outside the "
            rf"vocabulary of nn.Embedding 'embed' \({VOCAB} ids, 0..{VOCAB - 1}\)"
        )
        with pytest.raises(InvalidInput, match=message):
            manager.submit(**submit, x2_dataset=late.id)
        manager.submit(**submit, x2_dataset=late.id, x2_rows=(0, 5))  # rows without the bad one are fine
        assert len(manager.list()) == 1  # nothing else was stored
    finally:
        manager.stop()


def test_a_ray_job_over_named_arrays_equals_the_reference(
    ray_instance: object, tmp_path: Path, env: tuple[ModelRegistry, DatasetStore]
) -> None:
    registry, datasets = env
    x1, x2 = token_inputs(6, seed=4), token_inputs(4, seed=5)
    id1, id2 = datasets.create(_numpy(x1)).id, datasets.create(_numpy(x2)).id
    _, model = registry.load_module("tokens")
    manager = _manager(tmp_path, registry, datasets, RayExecutor(max_in_flight=2))
    try:
        full = _run(manager, model="tokens", x1_dataset=id1, x2_dataset=id2, dtype="float64", tile_size=2)
    finally:
        manager.stop()
    assert_matches(torch.from_numpy(full), reference_ntk(model, x1, x2))


def test_over_http_with_client(start_server: Any, tmp_path: Path) -> None:
    """A real server: upload named arrays with the client, submit a job, read the kernel; a bad side is a 422."""
    server: LiveServer = start_server(model_factories=TOKEN_FACTORY)
    x1, x2 = token_inputs(5, seed=6), token_inputs(3, seed=7)
    with Client(server.url, api_key=server.write_key) as client:
        client.register_model("tokens", TOKEN_MODEL, seed=3)
        d1 = client.upload_dataset(_numpy(x1))
        d2 = client.upload_dataset(_numpy(x2))
        job = client.submit_job("tokens", d1["id"], {"dataset": d2["id"], "start": 1, "stop": 3}, dtype="float64")
        assert job["output"] is None
        done = client.wait(job, progress=False, timeout=120)
        assert done["status"] == "succeeded", done["error"]
        theta = client.job_result(done["id"])
        weights = client.download_weights("tokens")
    model = build(dim=4, k=2)
    model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in weights.items()})
    expected = reference_ntk(model, x1, {k: t[1:3] for k, t in x2.items()})
    assert_matches(torch.as_tensor(np.asarray(theta)), expected)

    bad = _numpy(x2)
    bad["input_ids"] = bad["input_ids"].copy()
    bad["input_ids"][2, 1] = VOCAB + 4  # a late row: the one-example probe cannot see it
    with Client(server.url, api_key=server.write_key) as client:
        d3 = client.upload_dataset(bad)
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.write_key}"}) as http:
        response = http.post(
            "/v1/jobs", json={"model": "tokens", "x1": {"dataset": d1["id"]}, "x2": {"dataset": d3["id"]}}
        )
    assert response.status_code == 422, response.text
    assert (
        f"x2['input_ids'] (data set '{d3['id']}') has token id {VOCAB + 4} in row 2"
        in response.json()["error"]["message"]
    )
