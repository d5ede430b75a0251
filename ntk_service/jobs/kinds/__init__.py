"""Job kinds: one module each (plan / run / result, ``base.JobKind``), one row each in ``JOB_KINDS``.

The manager (``jobs/manager.py``) runs every kind through one lifecycle; the store (``jobs/store.py``) stores every
kind's typed values through the kind's own encoders. A new kind is a module here, its row below, and its routes
(``server/routes``, built with ``server/job_routes.py``).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from ntk_service.jobs.kinds.attribution import ATTRIBUTION_KIND
from ntk_service.jobs.kinds.attribution_features import ATTRIBUTION_FEATURES_KIND
from ntk_service.jobs.kinds.base import JobKind
from ntk_service.jobs.kinds.features import FEATURES_KIND
from ntk_service.jobs.kinds.kernel import KERNEL_KIND
from ntk_service.jobs.kinds.solve import SOLVE_KIND

__all__ = ["JOB_KINDS", "JobKind"]

JOB_KINDS: MappingProxyType[str, JobKind[Any, Any, Any, Any]] = MappingProxyType(
    {
        kind.name: kind
        for kind in (
            KERNEL_KIND,  # Θ of whole data sets in tiles, computed in panels by the executor (local or Ray)
            SOLVE_KIND,  # kernel ridge, GP mean or linearized predictions by operator CG, checkpointed per segment
            FEATURES_KIND,  # sketched NTK features Φ in chunks of rows
            ATTRIBUTION_FEATURES_KIND,  # a checkpoint's training side for data attribution, in chunks of rows
            ATTRIBUTION_KIND,  # attribution scores of a test set against stored training sides, in blocks of rows
        )
    }
)
"""Every job kind, by the name stored with its jobs."""
