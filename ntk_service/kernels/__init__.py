"""The kernel engine: empirical NTKs of PyTorch models. Pure math: no HTTP, no SQL, no settings.

``compute_ntk`` is the entry point; see its docstring and ``KernelMode`` for shapes. Beside it (docs/kernel_family.md):
``compute_nngp`` (NNGP and feature kernels), ``monte_carlo_ntk`` (kernels averaged over initializations),
``ntk_operator`` and ``dataset_operator`` (matrix-free Θ·v, in memory or over a data set read in chunks),
``ntk_features`` (sketched features, Gaussian or structured: ``SketchKind``), ``mode="pseudo"`` (the pseudo-NTK) and
``compute_ntk_groups`` (Θ per layer or parameter group). What a call computes is one ``KernelSpec`` (``spec=``), how
it computes one ``NtkOptions`` (``options=``): every public function takes both (``kernels/core.py``).
"""

from ntk_service.kernels.api import DEFAULT_IMPLEMENTATION, compute_ntk, compute_ntk_groups, warm_up
from ntk_service.kernels.family.monte_carlo import KernelKind, MonteCarloResult, monte_carlo_ntk
from ntk_service.kernels.family.nngp import NngpResult, compute_nngp
from ntk_service.kernels.groups import NtkGroupsResult, ParameterGroups, parameter_groups
from ntk_service.kernels.modes import DerivedMode, KernelMode
from ntk_service.kernels.operators.linear_operator import NtkOperator, ntk_operator
from ntk_service.kernels.operators.streaming_operator import dataset_operator
from ntk_service.kernels.options import NtkOptions
from ntk_service.kernels.runtime.allocator import release_freed_memory, retain_freed_memory, reuse_large_buffers
from ntk_service.kernels.runtime.device import (
    DEFAULT_DEVICE,
    default_memory_budget,
    device_memory_budget,
    model_device,
    parse_device,
    place_module,
)
from ntk_service.kernels.runtime.side_cache import SideCache
from ntk_service.kernels.sketch.features import (
    DEFAULT_SKETCH,
    MAX_FEATURE_DIM,
    SketchKind,
    feature_kernel,
    ntk_features,
)
from ntk_service.kernels.spec import KernelSpec
from ntk_service.kernels.structured import StructuredOptions
from ntk_service.kernels.types import NtkImplementation, NtkResult

__all__ = [
    "DEFAULT_DEVICE",
    "DEFAULT_IMPLEMENTATION",
    "DEFAULT_SKETCH",
    "DerivedMode",
    "MAX_FEATURE_DIM",
    "KernelKind",
    "KernelMode",
    "KernelSpec",
    "MonteCarloResult",
    "NngpResult",
    "NtkGroupsResult",
    "NtkImplementation",
    "NtkOptions",
    "NtkOperator",
    "NtkResult",
    "ParameterGroups",
    "SideCache",
    "SketchKind",
    "StructuredOptions",
    "compute_nngp",
    "compute_ntk",
    "compute_ntk_groups",
    "dataset_operator",
    "default_memory_budget",
    "device_memory_budget",
    "feature_kernel",
    "model_device",
    "parameter_groups",
    "parse_device",
    "place_module",
    "monte_carlo_ntk",
    "ntk_features",
    "ntk_operator",
    "release_freed_memory",
    "retain_freed_memory",
    "reuse_large_buffers",
    "warm_up",
]
