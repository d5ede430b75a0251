"""Data attribution from Python: which training examples drove each prediction, as two kinds of jobs on the server.

    >>> features = [client.submit_attribution_features("mlp", train=x_id, labels=y_id, version=v, seed=c)
    ...             for c, v in enumerate([2, 3, 4])]                                # doctest: +SKIP
    >>> for job in features:
    ...     client.wait_attribution_features(job["id"])      # rows done on stderr
    >>> job = client.submit_attribution([f["id"] for f in features], test=t_id, test_labels=ty_id, top_k=5)
    >>> client.wait_attribution_job(job["id"])              # stage, units and rows on stderr
    >>> result = client.attribution_result(job["id"])
    >>> result.proponents.shape, result.total_influence.shape                       # (M, 5), (N,)

    >>> result = client.attribute("mlp", train=x_id, labels=y_id, test=t_id, test_labels=ty_id,
    ...                           versions=[2, 3, 4], top_k=5)                      # both steps, features reused

The training side of each checkpoint is computed once and stored (an attribution features job); attribution jobs
score any number of test sets against it. The records are ``TypedDict``\\ s (plain dicts at run time).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TextIO, TypedDict, cast
from urllib.parse import quote

import numpy as np

from ntk_service import wire
from ntk_service.client._base import _decode_json, _decode_tensors
from ntk_service.client._job_routes import JobRoute, rows_body
from ntk_service.client._solve import SolveJobsClient, format_solve_progress
from ntk_service.client._types import DtypeName, JobStatusName

__all__ = [
    "AttributedExample",
    "AttributionClient",
    "AttributionExample",
    "AttributionFeaturesJob",
    "AttributionFeaturesSpec",
    "AttributionJob",
    "AttributionLossName",
    "AttributionProgress",
    "AttributionResult",
    "AttributionSpec",
    "FeatureKindName",
    "format_attribution_progress",
]

AttributionLossName = Literal["cross_entropy", "mse"]
"""The training loss: class indices for "cross_entropy", float targets for "mse"."""

FeatureKindName = Literal["structured", "gaussian", "exact"]
"""Where the features come from: the structured sketch, the Gaussian sketch, or the exact kernel."""

EnsembleName = Literal["trak", "mean"]
"""How checkpoints' scores combine."""

DEFAULT_DIM = 2048
"""The server's D when a features job names none (``ntk_service.attribution.DEFAULT_DIM``; the client imports
no torch): ``attribute`` matches stored features jobs against it."""


class RowsProgress(TypedDict):
    """Rows done of all."""

    rows_done: int
    rows_total: int


class AttributionFeaturesSpec(TypedDict):
    """What an attribution features job computes (resolved at submission)."""

    model: str
    version: int
    weights_sha256: str
    train_dataset: str
    train_start: int
    n: int
    labels_dataset: str
    labels_start: int
    k: int
    example_shape: list[int] | None
    loss: AttributionLossName
    features: FeatureKindName
    dim: int
    seed: int
    params: list[str] | None
    dtype: DtypeName | None
    memory_budget_bytes: int | None
    rows_per_chunk: int


class AttributionFeaturesSummary(TypedDict):
    """A finished features job: G' (n, dim), the Hessian rows and tr F."""

    n: int
    dim: int
    rows: int
    gram_trace: float


class AttributionFeaturesJob(TypedDict):
    """An attribution features job (``submit_attribution_features``, ...); times are UNIX seconds."""

    id: str
    job: Literal["attribution-features"]
    status: JobStatusName
    kind: str
    spec: AttributionFeaturesSpec
    progress: RowsProgress | None
    result: AttributionFeaturesSummary | None
    error: str | None
    created_at: float
    started_at: float | None
    finished_at: float | None


class AttributionSpec(TypedDict):
    """What an attribution job computes (resolved at submission)."""

    features: list[str]
    models: list[str]
    versions: list[int]
    dims: list[int]
    model: str
    loss: AttributionLossName
    feature_kind: FeatureKindName
    n: int
    train_dataset: str
    train_start: int
    labels_dataset: str
    labels_start: int
    test_dataset: str | None
    test_start: int
    m: int
    test_labels_dataset: str | None
    test_labels_start: int
    ridge: float
    ensemble: EnsembleName
    top_k: int
    store_scores: bool
    total_influence: bool
    self_influence: bool
    train_rows: int
    test_chunk: int
    test_dtype: DtypeName
    memory_budget_bytes: int
    memory_estimate_bytes: int


class AttributionProgress(TypedDict):
    """Where a running attribution job stands."""

    stage: Literal["test features", "scores", "total influence", "self influence", "done"]
    units_done: int
    units_total: int
    test_rows_done: int
    test_rows_total: int
    train_rows_scored: int
    train_rows_total: int


class AttributionSummary(TypedDict):
    """A finished attribution job: sizes, the answers stored, each checkpoint's absolute λ and solve."""

    n_train: int
    n_test: int
    checkpoints: int
    top_k: int
    answers: list[str]
    lam: list[float]
    methods: list[str]


class AttributionJob(TypedDict):
    """An attribution job (``submit_attribution``, ...); times are UNIX seconds."""

    id: str
    job: Literal["attribution"]
    status: JobStatusName
    kind: str
    spec: AttributionSpec
    progress: AttributionProgress | None
    result: AttributionSummary | None
    error: str | None
    created_at: float
    started_at: float | None
    finished_at: float | None


@dataclass(frozen=True)
class AttributionResult:
    """A succeeded attribution job's answers (None where the job did not compute one).

    Attributes:
        job: its id. rows: the test rows of the top-k arrays.
        proponents: (M, k) int64 training indices, largest score first. proponent_scores: (M, k) float32.
        opponents: (M, k) int64, most negative first. opponent_scores: (M, k) float32.
        total_influence: (N,) float64, Σ over the test set of τ(x*, x_n). self_influence: (N,) float64.
        lam: each checkpoint's absolute ridge λ. methods: each checkpoint's solve ("cholesky", ...).
    """

    job: str
    rows: tuple[int, int]
    proponents: np.ndarray | None
    proponent_scores: np.ndarray | None
    opponents: np.ndarray | None
    opponent_scores: np.ndarray | None
    total_influence: np.ndarray | None
    self_influence: np.ndarray | None
    lam: list[float]
    methods: list[str]


@dataclass(frozen=True)
class AttributedExample:
    """One example of ``AttributionExample``: its row (in the job's test or training rows), its score (None for
    the test example), its input (an array, or a dict of arrays for named inputs) and its label (None without)."""

    index: int
    score: float | None
    input: Any
    label: Any


@dataclass(frozen=True)
class AttributionExample:
    """A test example and its strongest training examples (``attribution_example``).

    Attributes:
        index: the test row. example_shape: one input's shape (a dict of shapes for named inputs).
        test: the test example. proponents, opponents: the training examples, strongest first.
    """

    index: int
    example_shape: Any
    test: AttributedExample
    proponents: list[AttributedExample]
    opponents: list[AttributedExample]


def format_attribution_progress(job: Mapping[str, Any]) -> str:
    """One line: ``running  scores  units 5/12  test rows 300/300  train rows 4096/10000`` (``running  rows
    512/2048`` for a features job)."""
    if job.get("job") != "attribution":
        return format_solve_progress({**job, "job": "features"})
    p = job.get("progress")
    if not p:
        return str(job.get("status", ""))
    line = f"{job.get('status', '')}  {p['stage']}  units {p['units_done']}/{p['units_total']}"
    if p.get("test_rows_total"):
        line += f"  test rows {p['test_rows_done']}/{p['test_rows_total']}"
    if p.get("train_rows_total"):
        line += f"  train rows {p['train_rows_scored']}/{p['train_rows_total']}"
    return line


def _example(data: Mapping[str, Any], score: bool) -> AttributedExample:
    value = data["input"]
    if isinstance(value, Mapping) and "data" not in value:
        inputs: Any = {name: wire.tensor_from_json(t, name=name) for name, t in value.items()}
    else:
        inputs = wire.tensor_from_json(value, name="input")
    return AttributedExample(
        index=int(data["index"]), score=float(data["score"]) if score else None, input=inputs, label=data["label"]
    )


_FEATURES_ROUTE: JobRoute[AttributionFeaturesJob] = JobRoute("/v1/attribution-features", format_attribution_progress)
_ATTRIBUTION_ROUTE: JobRoute[AttributionJob] = JobRoute("/v1/attribution-jobs", format_attribution_progress)


class AttributionClient(SolveJobsClient):
    """The ``/v1/attribution-features`` and ``/v1/attribution-jobs`` methods of ``Client``."""

    # ---- the training side of a checkpoint ----

    def submit_attribution_features(
        self,
        model: str,
        *,
        train: str | Mapping[str, Any],
        labels: str | Mapping[str, Any],
        version: int | None = None,
        loss: AttributionLossName = "cross_entropy",
        features: FeatureKindName = "structured",
        dim: int | None = None,
        seed: int = 0,
        params: list[str] | None = None,
        dtype: DtypeName | None = None,
        rows_per_chunk: int | None = None,
    ) -> AttributionFeaturesJob:
        """Queue an attribution features job (POST /v1/attribution-features): one checkpoint's training side.

        Args:
            model: the registered model. version: the checkpoint (a version of it). Default: the latest.
            train: the training inputs, a data set id or {"dataset", "start", "stop"}. labels: their labels, aligned
                rows: class indices (N,) for cross_entropy, targets (N, *out) for mse.
            loss, features, dim, seed, params, dtype, rows_per_chunk: as the route's fields (None: the server's
                default; dim: 2048). Give each checkpoint of an ensemble its own seed.

        Returns:
            AttributionFeaturesJob: the queued job.

        Raises:
            InvalidInput / ShapeMismatch (422): a bad option, labels out of range or of the wrong shape.
            MemoryEstimateExceeded (413). ModelNotFound / DatasetNotFound (404).
        """
        body = {
            "model": model, "version": version, "train": rows_body(train), "labels": rows_body(labels), "loss": loss,
            "features": features, "dim": dim, "seed": seed, "params": params, "dtype": dtype,
            "rows_per_chunk": rows_per_chunk,
        }  # fmt: skip
        return self._submit_job(_FEATURES_ROUTE, body)

    def attribution_features_job(self, job_id: str) -> AttributionFeaturesJob:
        """The features job (GET /v1/attribution-features/{id}), progress {rows_done, rows_total}."""
        return self._job(_FEATURES_ROUTE, job_id)

    def list_attribution_features(self) -> list[AttributionFeaturesJob]:
        """Every attribution features job, newest first."""
        return self._jobs(_FEATURES_ROUTE)

    def cancel_attribution_features(self, job_id: str) -> AttributionFeaturesJob:
        """Cancel a queued or running features job (it stops between chunks); returns the job."""
        return self._cancel_job(_FEATURES_ROUTE, job_id)

    def delete_attribution_features(self, job_id: str) -> dict[str, Any]:
        """Delete a finished features job and its stored features; {"id", "deleted", "freed_bytes"} (a queued or
        running job is cancelled and returned instead).

        Raises:
            JobNotFound (404). Conflict (409): an attribution job is scoring against it.
        """
        return self._delete_job(_FEATURES_ROUTE, job_id)

    def wait_attribution_features(
        self,
        job_id: str,
        *,
        poll_s: float = 0.5,
        timeout_s: float | None = None,
        progress: TextIO | Literal["stderr"] | None = "stderr",
    ) -> AttributionFeaturesJob:
        """Follow a features job until it ends (``wait_solve_job``'s event stream and polling), printing the rows
        done to ``progress``. Raises JobFailed when it failed."""
        return self._wait_job(_FEATURES_ROUTE, job_id, poll_s, timeout_s, progress)

    # ---- scoring test sets ----

    def submit_attribution(
        self,
        features: str | Sequence[str],
        *,
        test: str | Mapping[str, Any] | None = None,
        test_labels: str | Mapping[str, Any] | None = None,
        ridge: float | None = None,
        ensemble: EnsembleName = "trak",
        top_k: int | None = None,
        store_scores: bool = False,
        total_influence: bool = True,
        self_influence: bool = False,
        train_rows: int | None = None,
        test_rows_per_chunk: int | None = None,
    ) -> AttributionJob:
        """Queue an attribution job (POST /v1/attribution-jobs) against succeeded features jobs.

        Args:
            features: a features job id, or one per checkpoint of the ensemble.
            test: the test inputs (a data set id or rows); None: only the self-influence. test_labels: their class
                indices (None: the predicted class) or targets (mse: required).
            ridge: λ relative to the mean diagonal (None: the server's default, 0.3). ensemble: "trak" or "mean".
            top_k: proponents and opponents per test example (0: none; None: the server's 10, at most N).
                store_scores: keep the dense (M, N) scores. total_influence, self_influence: the answers per
                training example.
            train_rows, test_rows_per_chunk: units of work (None: planned for the memory budget).

        Returns:
            AttributionJob: the queued job.

        Raises:
            JobNotFound (404) / JobNotFinished (409): a features job missing or not succeeded. InvalidInput /
            ShapeMismatch / IncompatibleCheckpoint (422). MemoryEstimateExceeded / DiskEstimateExceeded (413).
        """
        ids = [features] if isinstance(features, str) else list(features)
        body = {
            "features": ids, "test": rows_body(test), "test_labels": rows_body(test_labels), "ridge": ridge,
            "ensemble": ensemble, "top_k": top_k, "store_scores": store_scores, "total_influence": total_influence,
            "self_influence": self_influence, "train_rows": train_rows, "test_rows_per_chunk": test_rows_per_chunk,
        }  # fmt: skip
        return self._submit_job(_ATTRIBUTION_ROUTE, body)

    def attribution_job(self, job_id: str) -> AttributionJob:
        """The attribution job (GET /v1/attribution-jobs/{id}): progress while it runs, summary once finished."""
        return self._job(_ATTRIBUTION_ROUTE, job_id)

    def list_attribution_jobs(self) -> list[AttributionJob]:
        """Every attribution job, newest first."""
        return self._jobs(_ATTRIBUTION_ROUTE)

    def cancel_attribution_job(self, job_id: str) -> AttributionJob:
        """Cancel a queued or running attribution job (it stops between units); returns the job."""
        return self._cancel_job(_ATTRIBUTION_ROUTE, job_id)

    def delete_attribution_job(self, job_id: str) -> dict[str, Any]:
        """Delete a finished attribution job and its arrays (a queued or running one is cancelled instead)."""
        return self._delete_job(_ATTRIBUTION_ROUTE, job_id)

    def wait_attribution_job(
        self,
        job_id: str,
        *,
        poll_s: float = 0.5,
        timeout_s: float | None = None,
        progress: TextIO | Literal["stderr"] | None = "stderr",
    ) -> AttributionJob:
        """Follow an attribution job until it ends, printing ``format_attribution_progress`` lines. Raises
        JobFailed when it failed."""
        return self._wait_job(_ATTRIBUTION_ROUTE, job_id, poll_s, timeout_s, progress)

    def attribution_result(self, job_id: str, *, rows: tuple[int, int] | None = None) -> AttributionResult:
        """A succeeded attribution job's answers (safetensors): the top-k arrays of test ``rows`` (default: all),
        the total and self influence.

        Raises:
            JobNotFinished (409): not succeeded. PayloadTooLarge (413): more rows than one answer may hold.
        """
        params = {} if rows is None else {"rows": f"{rows[0]}:{rows[1]}"}
        path = f"/v1/attribution-jobs/{quote(job_id, safe='')}/result"
        response = self._request("GET", path, accept=wire.MEDIA_SAFETENSORS, params=params)
        arrays, metadata = _decode_tensors(response, npy_name="proponents")
        meta = {name: wire.json_loads(value) for name, value in metadata.items()}
        span = meta.get("rows") or [0, 0]
        return AttributionResult(
            job=job_id, rows=(int(span[0]), int(span[1])), proponents=arrays.get("proponents"),
            proponent_scores=arrays.get("proponent_scores"), opponents=arrays.get("opponents"),
            opponent_scores=arrays.get("opponent_scores"), total_influence=arrays.get("total_influence"),
            self_influence=arrays.get("self_influence"), lam=[float(v) for v in meta.get("lam", [])],
            methods=[str(v) for v in meta.get("methods", [])],
        )  # fmt: skip

    def attribution_scores(
        self, job_id: str, *, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
    ) -> np.ndarray:
        """A block of the dense scores (r, c) float32 of a job that kept them (``store_scores``), as .npy.

        Raises:
            ResultNotFound (404): the job kept no dense scores. PayloadTooLarge (413): ask for a smaller block.
        """
        params = {name: f"{span[0]}:{span[1]}" for name, span in (("rows", rows), ("cols", cols)) if span is not None}
        path = f"/v1/attribution-jobs/{quote(job_id, safe='')}/scores"
        response = self._request("GET", path, accept=wire.MEDIA_NPY, params=params)
        scores: np.ndarray = _decode_tensors(response, npy_name="scores")[0]["scores"]
        return scores

    def attribution_example(self, job_id: str, index: int, *, k: int | None = None) -> AttributionExample:
        """Test example ``index`` of a succeeded job and its ``k`` strongest proponents and opponents (default: the
        job's top_k), with their inputs and labels (GET /v1/attribution-jobs/{id}/examples/{index})."""
        path = f"/v1/attribution-jobs/{quote(job_id, safe='')}/examples/{int(index)}"
        response = self._request("GET", path, accept=wire.MEDIA_JSON, params={} if k is None else {"k": k})
        data = _decode_json(response)
        return AttributionExample(
            index=int(data["index"]),
            example_shape=data["example_shape"],
            test=_example(data["test"], score=False),
            proponents=[_example(e, score=True) for e in data["proponents"]],
            opponents=[_example(e, score=True) for e in data["opponents"]],
        )

    # ---- both steps ----

    def attribute(
        self,
        model: str,
        *,
        train: str | Mapping[str, Any],
        labels: str | Mapping[str, Any],
        test: str | Mapping[str, Any] | None = None,
        test_labels: str | Mapping[str, Any] | None = None,
        versions: Sequence[int | None] = (None,),
        loss: AttributionLossName = "cross_entropy",
        features: FeatureKindName = "structured",
        dim: int | None = None,
        seed: int = 0,
        params: list[str] | None = None,
        dtype: DtypeName | None = None,
        ridge: float | None = None,
        ensemble: EnsembleName = "trak",
        top_k: int | None = None,
        store_scores: bool = False,
        total_influence: bool = True,
        self_influence: bool = False,
        timeout_s: float | None = None,
        progress: TextIO | Literal["stderr"] | None = "stderr",
    ) -> AttributionResult:
        """Attribute a test set to the training set over the checkpoints ``versions``, both steps: the features of
        each checkpoint (checkpoint c sketched with ``seed + c``, as ``fit_attributor`` does), reusing a succeeded
        features job of the same spec, then the scores. Waits for each job, printing progress.

        Returns:
            AttributionResult (its ``job`` is the attribution job's id).

        Raises:
            What ``submit_attribution_features`` and ``submit_attribution`` raise; JobFailed when a job fails.
        """
        done = self.list_attribution_features()
        ids = []
        for c, version in enumerate(versions):
            found = self._stored_features(done, model, version, train, labels, loss=loss, features=features,
                                          dim=dim, seed=seed + c, params=params, dtype=dtype)  # fmt: skip
            if found is None:
                job = self.submit_attribution_features(
                    model, train=train, labels=labels, version=version, loss=loss, features=features, dim=dim,
                    seed=seed + c, params=params, dtype=dtype,
                )  # fmt: skip
                found = self.wait_attribution_features(job["id"], timeout_s=timeout_s, progress=progress)["id"]
            ids.append(found)
        scoring = self.submit_attribution(
            ids, test=test, test_labels=test_labels, ridge=ridge, ensemble=ensemble, top_k=top_k,
            store_scores=store_scores, total_influence=total_influence, self_influence=self_influence,
        )  # fmt: skip
        self.wait_attribution_job(scoring["id"], timeout_s=timeout_s, progress=progress)
        return self.attribution_result(scoring["id"])

    def _stored_features(
        self, jobs: Sequence[AttributionFeaturesJob], model: str, version: int | None,
        train: str | Mapping[str, Any], labels: str | Mapping[str, Any], **options: Any,
    ) -> str | None:  # fmt: skip
        """The id of a succeeded features job of this checkpoint, rows and options, else None."""
        resolved = version
        if resolved is None:  # the latest version, as the server resolves it
            resolved = int(self._get_json(f"/v1/models/{quote(model, safe='')}")["version"])

        def rows_of(value: str | Mapping[str, Any]) -> tuple[str, int, int]:
            side = cast(dict[str, Any], rows_body(value))
            stop = side.get("stop")
            if stop is None:
                stop = int(self._get_json(f"/v1/datasets/{quote(side['dataset'], safe='')}")["shape"][0])
            return str(side["dataset"]), int(side.get("start") or 0), int(stop)

        x, y = rows_of(train), rows_of(labels)
        wanted = {name: options[name] for name in ("loss", "features", "seed", "params")}
        if options["features"] != "exact":
            wanted["dim"] = options["dim"] or DEFAULT_DIM
        for job in jobs:
            spec = cast(dict[str, Any], job["spec"])
            same_rows = (spec["train_dataset"], spec["train_start"], spec["train_start"] + spec["n"]) == x and (
                spec["labels_dataset"], spec["labels_start"], spec["labels_start"] + spec["n"]) == y  # fmt: skip
            if (
                job["status"] == "succeeded"
                and (spec["model"], spec["version"]) == (model, resolved)
                and same_rows
                and all(spec[name] == value for name, value in wanted.items())
                and options["dtype"] in (None, spec["dtype"])
            ):
                return job["id"]
        return None
