"""The public surface is explicit: each package's ``__all__`` lists exactly its public names (httpx's test)."""

from __future__ import annotations
import __future__

import importlib
import inspect
import types

import pytest

import ntk_service

PUBLIC_DUNDERS = {"__version__"}


def _public_names(module: types.ModuleType) -> set[str]:
    """Public names bound in the module and defined in its package: not submodules, not imported helpers
    (``typing.Any``, ``numpy``), not ``from __future__`` features."""
    names = set()
    for name, value in vars(module).items():
        if name.startswith("_") and name not in PUBLIC_DUNDERS:
            continue
        if isinstance(value, types.ModuleType | __future__._Feature):
            continue
        imported = inspect.isclass(value) or inspect.isroutine(value)
        if imported and not value.__module__.startswith(module.__name__):
            continue
        names.add(name)
    return names


def test_package_all_is_sorted_and_complete() -> None:
    assert ntk_service.__all__ == sorted(ntk_service.__all__)
    for name in ntk_service.__all__:
        getattr(ntk_service, name)  # lazy names resolve
    assert _public_names(ntk_service) == set(ntk_service.__all__)


def test_package_version_matches_the_distribution() -> None:
    from importlib.metadata import version

    assert ntk_service.__version__ == version("ntk-service")


def test_lazy_exports_are_the_client_classes() -> None:
    from ntk_service.client import Client, KernelResult

    assert ntk_service.Client is Client and ntk_service.KernelResult is KernelResult
    assert "Client" in dir(ntk_service)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ntk_service.nope  # noqa: B018


@pytest.mark.parametrize(
    "module_name",
    [
        "ntk_service.analysis",
        "ntk_service.analysis.solve",
        "ntk_service.attribution",
        "ntk_service.client",
        "ntk_service.wire",
        "ntk_service.cli",
        "ntk_service.layers",
    ],
)
def test_module_all_lists_its_public_names(module_name: str) -> None:
    module = importlib.import_module(module_name)
    assert sorted(module.__all__) == sorted(set(module.__all__))
    assert _public_names(module) == set(module.__all__)
