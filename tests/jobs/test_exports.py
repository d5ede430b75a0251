"""The public surface of ``ntk_service.jobs`` is exactly its ``__all__`` (nothing leaks, nothing is missing)."""

from __future__ import annotations

import ntk_service.jobs
import ntk_service.jobs.executors


def test_jobs_exports() -> None:
    for module in (ntk_service.jobs, ntk_service.jobs.executors):
        public = {name for name in vars(module) if not name.startswith("_") and not _is_submodule(module, name)}
        assert set(module.__all__) == public - {"annotations"}


def _is_submodule(module: object, name: str) -> bool:
    value = getattr(module, name)
    return type(value).__name__ == "module"
