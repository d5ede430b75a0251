"""The kernel engine: empirical NTKs of PyTorch models. Pure math: no HTTP, no SQL, no settings.

``compute_ntk`` is the entry point; see its docstring and ``KernelMode`` for shapes.
"""

from ntk_service.kernels.allocator import retain_freed_memory
from ntk_service.kernels.api import DEFAULT_IMPLEMENTATION, compute_ntk, warm_up
from ntk_service.kernels.device import (
    DEFAULT_DEVICE,
    device_memory_budget,
    model_device,
    parse_device,
    place_module,
)
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.planning import default_memory_budget
from ntk_service.kernels.side_cache import SideCache
from ntk_service.kernels.types import NtkImplementation, NtkResult

__all__ = [
    "DEFAULT_DEVICE",
    "DEFAULT_IMPLEMENTATION",
    "KernelMode",
    "NtkImplementation",
    "NtkResult",
    "SideCache",
    "compute_ntk",
    "default_memory_budget",
    "device_memory_budget",
    "model_device",
    "parse_device",
    "place_module",
    "retain_freed_memory",
    "warm_up",
]
