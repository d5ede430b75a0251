"""Attribution features jobs over HTTP: the training side of one checkpoint (a model version) for data attribution,
computed once and stored (``jobs/kinds/attribution_features.py``); attribution jobs (``routes/attribution_jobs.py``)
score test sets against it.

    POST   /v1/attribution-features              202 + Location: the queued job
    GET    /v1/attribution-features              {"data": [job, ...], "count"}, newest first
    GET    /v1/attribution-features/{id}         the job: progress {rows_done, rows_total}; result {n, dim, rows,
                                                 gram_trace} once succeeded
    GET    /v1/attribution-features/{id}/events  text/event-stream: a "progress" event per change, "end" at the end
    DELETE /v1/attribution-features/{id}         cancel a queued or running job (it stops between chunks); delete a
                                                 finished one with its features (?cancel_only=true: only cancel);
                                                 409 while an attribution job scores against it
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ntk_service.attribution import DEFAULT_DIM
from ntk_service.jobs.kinds.attribution_features import ATTRIBUTION_FEATURES_KIND, AttributionFeaturesRequest
from ntk_service.kernels.sketch.features import MAX_FEATURE_DIM
from ntk_service.server.job_routes import JobRouteText, job_router
from ntk_service.server.params import ID_MAX_LENGTH, INT64_MAX, MAX_GLOBS, Glob
from ntk_service.server.routes.solve_jobs import SolveRows

__all__ = ["AttributionFeaturesCreate", "router"]


class AttributionFeaturesCreate(BaseModel):
    """``POST /v1/attribution-features``: the training side of one checkpoint (G' (N, D), the loss weights and the
    Gram matrix F), stored for attribution jobs to score against."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=ID_MAX_LENGTH, description="Registered model name.")
    version: int | None = Field(
        None, ge=1, le=INT64_MAX, description="The checkpoint: a version of the model. Default: the latest."
    )
    train: SolveRows = Field(description="The training inputs: N examples.")
    labels: SolveRows = Field(
        description="Their labels, one row per training example: class indices (N,) int64 for cross_entropy, "
        "targets (N, *out) for mse."
    )
    loss: Literal["cross_entropy", "mse"] = Field("cross_entropy", description="The training loss.")
    features: Literal["structured", "gaussian", "exact"] = Field(
        "structured",
        description="structured: the Kronecker sketch of δ ⊗ a (D columns); gaussian: J R / √D, for models the "
        "structured sketch refuses; exact: the exact kernel's eigenvectors (no sketch, N·c × N·c in memory).",
    )
    dim: int = Field(DEFAULT_DIM, ge=1, le=MAX_FEATURE_DIM, description=f"D, 1 to {MAX_FEATURE_DIM} (not for exact).")
    seed: int = Field(
        0, ge=0, le=INT64_MAX, description="The sketch's seed; give each checkpoint of an ensemble its own."
    )
    params: list[Glob] | None = Field(
        None, max_length=MAX_GLOBS, description="Attribute through these parameters only (globs); null = all."
    )
    dtype: Literal["float32", "float64"] | None = Field(None, description="Compute dtype. Default: the model's.")
    rows_per_chunk: int | None = Field(
        None, ge=1, le=1_000_000, description="Training rows per unit. Default: what the memory budget holds."
    )


def _request(body: AttributionFeaturesCreate) -> AttributionFeaturesRequest:
    fields = body.model_dump(exclude={"train", "labels"})
    return AttributionFeaturesRequest(**fields, train=body.train.rows(), labels=body.labels.rows())


router = job_router(
    ATTRIBUTION_FEATURES_KIND,
    create=AttributionFeaturesCreate,
    request_of=_request,
    text=JobRouteText(
        noun="attribution_features",
        tag="attribution",
        progress="rows done",
        cancel="it stops between chunks of rows",
        delete="its stored features",
    ),
)
