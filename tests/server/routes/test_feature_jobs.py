"""Features jobs against a real uvicorn process: Φ (N, k, D) stored as zarr, the same seed giving the same bits on
any chunking, and kernels from features whose mean over seeds matches the float64 reference kernel."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import xarray as xr

from ntk_service.client import Client
from ntk_service.errors import InvalidInput
from ntk_service.jobs.features_job import FeaturesSpec, check_pairable
from ntk_service.kernels import ntk_features
from ntk_service.registry import build_model
from tests.conftest import LiveServer, start_live_server
from tests.jobs.conftest import TINY_MLP, tiny_model_from_weights
from tests.reference import reference_ntk

N, M, K, D = 6, 4, 3, 256


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    data_dir = tmp_path_factory.mktemp("feature-jobs")
    live: LiveServer = start_live_server(data_dir)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((N, 4)).astype(np.float32)
    t = rng.standard_normal((M, 4)).astype(np.float32)
    with Client(live.url, api_key=live.write_key) as client:
        client.register_model("tiny", TINY_MLP, seed=0)
        model = tiny_model_from_weights(client.download_weights("tiny")).double()
        ids = {"x": client.upload_dataset(x)["id"], "t": client.upload_dataset(t)["id"]}
        yield {"client": client, "x": x, "t": t, "ids": ids, "model": model, "data_dir": data_dir}
    live.stop()


def _features(client: Client, dataset: str, seed: int, **options: Any) -> str:
    job = client.submit_features_job("tiny", dataset=dataset, dim=D, seed=seed, dtype="float64", **options)
    done = client.wait_features_job(job["id"], poll_s=0.05, timeout_s=120, progress=None)
    assert done["status"] == "succeeded", done
    assert done["progress"] == {"rows_done": done["spec"]["n"], "rows_total": done["spec"]["n"]}
    return str(job["id"])


def test_features_job_stores_phi_as_zarr_and_one_seed_gives_the_same_bits_on_any_chunking(
    setup: dict[str, Any],
) -> None:
    client, ids = setup["client"], setup["ids"]
    whole = _features(client, ids["x"], seed=11)
    chunked = _features(client, ids["x"], seed=11, rows_per_chunk=1)
    other = _features(client, ids["x"], seed=12)
    phi = client.features_result(whole)
    assert phi.shape == (N, K, D) and phi.dtype == np.float64
    np.testing.assert_array_equal(client.features_result(chunked), phi)
    assert not np.allclose(client.features_result(other), phi)
    np.testing.assert_array_equal(client.features_result(whole, rows=(2, 5)), phi[2:5])
    stored = xr.open_zarr(setup["data_dir"] / "jobs" / "solve" / whole / "features.zarr", consolidated=False)["phi"]
    assert stored.dims == ("example", "output", "feature")
    np.testing.assert_array_equal(stored.values, phi)


def test_kernels_from_features_average_to_the_reference_kernel(setup: dict[str, Any]) -> None:
    """The mean over S seeds of Φ1 Φ2ᵀ against the exact Θ(x, t).

    Tolerance: for a Gaussian sketch each entry of Φ1 Φ2ᵀ is unbiased with variance (Θ12_ij² + Θ11_ii Θ22_jj) / D
    (Wick's theorem, NOTE [sketch error] in kernels/sketch/features.py), so E‖Φ1Φ2ᵀ − Θ12‖²_F = (‖Θ12‖²_F + tr Θ11 ·
    tr Θ22) / D exactly, and the mean of S independent seeds divides it by S. Markov's inequality on the squared
    error gives P(error > 3·rms) ≤ 1/9 for any seeds; the seeds are fixed, so the test is deterministic, and the
    bound is not tuned to them (here the error is 0.94 rms).
    """
    client, ids, model = setup["client"], setup["ids"], setup["model"]
    seeds = range(20, 28)
    gaussian = {"sketch": "gaussian"}  # the tolerance below is the Gaussian sketch's variance
    pairs = [(_features(client, ids["x"], s, **gaussian), _features(client, ids["t"], s, **gaussian)) for s in seeds]
    estimates = np.stack([client.feature_kernel(a, b, mode="full") for a, b in pairs])
    assert estimates.shape == (len(seeds), N, M, K, K)
    xt, tt = torch.from_numpy(setup["x"]).double(), torch.from_numpy(setup["t"]).double()
    exact = reference_ntk(model, xt, tt, mode="full").numpy()
    diag_x = np.einsum("nnaa->", reference_ntk(model, xt, mode="full").numpy())
    diag_t = np.einsum("nnaa->", reference_ntk(model, tt, mode="full").numpy())
    rms = np.sqrt((np.sum(exact**2) + diag_x * diag_t) / (D * len(seeds)))
    error = np.linalg.norm(estimates.mean(0) - exact)
    assert error <= 3 * rms, (error, rms)
    assert rms < 0.1 * np.linalg.norm(exact)  # the bound itself says something: under 30 % relative error
    single = np.linalg.norm(estimates[0] - exact)
    assert error < single  # averaging seeds helps: the estimate is unbiased, its error is noise
    trace = client.feature_kernel(pairs[0][0], pairs[0][1], mode="trace", rows=(1, 3))
    assert trace.shape == (2, M)


def test_a_feature_dimension_over_the_limit_is_a_422(setup: dict[str, Any]) -> None:
    client, ids = setup["client"], setup["ids"]
    with pytest.raises(InvalidInput, match="dim") as caught:
        client.submit_features_job("tiny", dataset=ids["x"], dim=10**6)
    assert caught.value.http_status == 422  # type: ignore[attr-defined]
    with pytest.raises(InvalidInput, match="outside the data set of 6 rows"):
        client.submit_features_job("tiny", dataset={"dataset": ids["x"], "start": 4, "stop": 9}, dim=8)


def test_the_sketch_kind_is_a_job_field_and_only_matching_jobs_pair_into_a_kernel(setup: dict[str, Any]) -> None:
    client, ids = setup["client"], setup["ids"]
    model, _ = build_model(TINY_MLP, seed=0)  # the server's module: the draws are keyed by parameter names
    weights = client.download_weights("tiny")
    model.load_state_dict({name: torch.as_tensor(np.asarray(value)) for name, value in weights.items()})
    model, x = model.double(), torch.from_numpy(setup["x"]).double()
    jobs = {kind: _features(client, ids["x"], seed=31, sketch=kind) for kind in ("structured", "gaussian")}
    default = _features(client, ids["x"], seed=31)
    assert client.features_job(default)["spec"]["sketch"] == "structured"  # the library's DEFAULT_SKETCH
    for kind, job in jobs.items():  # the job's Φ is the library's for that kind (the numerics: tests/kernels)
        assert client.features_job(job)["spec"]["sketch"] == kind
        expected = ntk_features(model, x, dim=D, seed=31, sketch=kind).numpy()
        np.testing.assert_allclose(client.features_result(job), expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(InvalidInput, match="differ in sketch 'structured' vs 'gaussian'") as caught:
        client.feature_kernel(jobs["structured"], jobs["gaussian"])
    assert caught.value.http_status == 422  # type: ignore[attr-defined]
    with pytest.raises(InvalidInput, match="differ in seed 31 vs 32"):
        client.feature_kernel(jobs["gaussian"], _features(client, ids["t"], seed=32, sketch="gaussian"))
    with pytest.raises(InvalidInput, match="sketch"):
        client.submit_features_job("tiny", dataset=ids["x"], dim=8, sketch="srht")  # type: ignore[arg-type]


def test_a_spec_stored_before_the_sketch_field_reads_as_gaussian() -> None:
    stored = {"model": "m", "version": 1, "dataset": "d", "start": 0, "n": 4, "k": 2, "dim": 8, "seed": 3}
    assert FeaturesSpec(**stored).sketch == "gaussian"  # the only sketch then: a rerun gives the same Φ
    check_pairable(stored, {**stored, "sketch": "gaussian", "n": 9})
    with pytest.raises(InvalidInput, match="sketch 'gaussian' vs 'structured'"):
        check_pairable(stored, {**stored, "sketch": "structured"})
