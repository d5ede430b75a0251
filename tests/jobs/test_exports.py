"""The public surface of ``ntk_service.jobs`` is exactly its ``__all__`` (nothing leaks, nothing is missing)."""

from __future__ import annotations

import ntk_service.jobs
import ntk_service.jobs.executors
import ntk_service.results


def test_jobs_exports() -> None:
    for module in (ntk_service.jobs, ntk_service.jobs.executors):
        public = {name for name in vars(module) if not name.startswith("_") and not _is_submodule(module, name)}
        assert set(module.__all__) == public - {"annotations"}


def test_results_exports() -> None:
    module = ntk_service.results
    assert (
        module.__all__ == sorted(module.__all__) == ["FORMAT_VERSION", "ResultView", "compute_ntk_tiled", "open_result"]
    )
    public = {name for name in vars(module) if not name.startswith("_") and not _is_submodule(module, name)}
    assert public - {"annotations"} == set(module.__all__)


def _is_submodule(module: object, name: str) -> bool:
    value = getattr(module, name)
    return type(value).__name__ == "module"
