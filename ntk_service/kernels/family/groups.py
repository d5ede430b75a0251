"""Deprecated home of the parameter groups: ``ntk_service.kernels.groups`` (an engine primitive, below ``api.py``).

Kept for one release; importing it warns ``DeprecationWarning``.
"""

from __future__ import annotations

import warnings

from ntk_service.kernels.groups import (
    MODULE_GROUPS,
    REST_GROUP,
    ROOT_GROUP,
    GroupSpec,
    NtkGroupsResult,
    ParameterGroups,
    parameter_groups,
)

__all__ = [
    "MODULE_GROUPS",
    "REST_GROUP",
    "ROOT_GROUP",
    "GroupSpec",
    "NtkGroupsResult",
    "ParameterGroups",
    "parameter_groups",
]

warnings.warn(
    "ntk_service.kernels.family.groups is deprecated and will be removed in the next release; import from "
    "ntk_service.kernels.groups (or ntk_service.kernels)",
    DeprecationWarning,
    stacklevel=2,
)
