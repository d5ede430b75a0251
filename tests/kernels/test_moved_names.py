"""Names that moved when kernels/ was put in layers keep working from their old homes for one release, with a
DeprecationWarning that names the new one."""

from __future__ import annotations

import importlib

import pytest

from ntk_service.kernels import derived, groups
from ntk_service.kernels.runtime import device


@pytest.mark.parametrize(
    ("old", "new", "names"),
    [
        ("ntk_service.kernels.family.groups", groups, ["ParameterGroups", "parameter_groups", "NtkGroupsResult"]),
        ("ntk_service.kernels.family.pseudo", derived, ["SummedOutputs", "pseudo_key", "pseudo_params"]),
    ],
)
def test_old_modules_warn_and_name_the_same_objects(old: str, new: object, names: list[str]) -> None:
    module = importlib.import_module(old)
    for name in names:
        with pytest.warns(DeprecationWarning, match=f"{old}.{name} is deprecated.*use {new.__name__}.{name}"):  # type: ignore[attr-defined]
            assert getattr(module, name) is getattr(new, name)
    with pytest.raises(AttributeError, match="has no attribute 'compute_ntk'"):
        module.compute_ntk  # noqa: B018


@pytest.mark.parametrize("name", ["default_memory_budget", "DEFAULT_MEMORY_FRACTION", "BUDGET_REFRESH_SECONDS"])
def test_the_planners_old_budget_names_warn_and_are_the_runtimes(name: str) -> None:
    from ntk_service.kernels import planning

    with pytest.warns(
        DeprecationWarning, match=f"planning.{name} is deprecated.*use ntk_service.kernels.runtime.device.{name}"
    ):
        value = getattr(planning, name)
    assert value is getattr(device, name)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        planning.no_such_name  # noqa: B018
