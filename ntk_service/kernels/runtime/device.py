"""Where a kernel runs: device strings, the memory budget of each device, model placement and the TF32 policy.

    >>> parse_device("cpu")
    device(type='cpu')
    >>> parse_device("cuda:1", cuda_devices=2)
    device(type='cuda', index=1)
    >>> parse_device("cuda", cuda_devices=0)  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    UnknownDevice: compute_ntk: device 'cuda' was asked for but CUDA is not available here ...

NOTE [device budgets]: the planner sizes blocks for the memory of the device that computes, and host and device
budgets are separate numbers. On the CPU the budget is ``default_memory_budget()`` (half of MemAvailable, plus
what malloc keeps free for this process). On a CUDA device it is half of what this process can still get there:
the driver's free memory (``torch.cuda.mem_get_info``) plus what torch's caching allocator holds but no tensor uses
(reserved minus allocated), which the allocator hands out before asking the driver. A kernel on the GPU therefore
never plans against host RAM, and the host budget (results copied back to the CPU, job tiles written to disk)
never counts GPU memory. The readers are a table (``MEMORY_BUDGETS``) passed as an argument, so tests choose them
explicitly.

NOTE [TF32]: on Ampere and later GPUs, float32 matmuls and convolutions may run on TF32 tensor cores (10-bit
mantissa inputs, ~1e-3 relative error): fast, but not float32. Kernels here are float32 unless TF32 is allowed
explicitly (``allow_tf32=True``, ``NTK_ALLOW_TF32``); float64 never uses it. torch keeps the switches
(``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``, the latter True by default)
process-wide, so ``tf32_policy`` sets them for the duration of a CUDA computation and restores them after the
last one: computations that agree run at once, one that disagrees waits for the others to finish.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

import torch
from torch import nn

from ntk_service.errors import UnknownDevice, UnsupportedModel
from ntk_service.kernels.runtime.allocator import free_heap_bytes

__all__ = [
    "BUDGET_REFRESH_SECONDS",
    "CUDA_MEMORY_FRACTION",
    "DEFAULT_DEVICE",
    "DEFAULT_MEMORY_FRACTION",
    "MEMORY_BUDGETS",
    "BudgetSource",
    "Tf32Policy",
    "cuda_memory_budget",
    "default_memory_budget",
    "device_memory_budget",
    "host_memory_budget",
    "model_device",
    "parse_device",
    "place_module",
    "tf32_policy",
]

DEFAULT_DEVICE = "cpu"
"""Kernels run on the CPU unless a device is asked for: every machine has one, and results need no copy."""

DEFAULT_MEMORY_FRACTION = 0.5
"""Default budget: half of the memory available now, leaving room for the process, other requests and the OS."""

CUDA_MEMORY_FRACTION = DEFAULT_MEMORY_FRACTION
"""The share of a GPU's obtainable memory a kernel may plan for: the host's half, since the planner's estimates
are not tight enough to go closer and the caching allocator fragments (not tuned on a GPU: none was available)."""

_DEVICE_PATTERN = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


def parse_device(
    device: str | torch.device | None,
    *,
    cuda_devices: int | None = None,
    operation: str = "compute_ntk",
) -> torch.device:
    """The ``torch.device`` for ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (or a ``torch.device``), checked to exist.

    Args:
        device (str or torch.device or None): the device; None means ``DEFAULT_DEVICE``.
        cuda_devices (int, optional): CUDA devices visible. Default: ``torch.cuda.device_count()`` (0 without
            CUDA); tests pass a count to check the index rule on any machine.
        operation (str): the operation named in error messages. Default: "compute_ntk".

    Returns:
        torch.device: ``cpu``, or ``cuda:N`` with an explicit index (``"cuda"`` is the current CUDA device).

    Raises:
        UnknownDevice: not one of the accepted forms, CUDA asked for where it is absent, or an index past the
            visible devices; the message says what this machine has.
    """
    text = DEFAULT_DEVICE if device is None else str(device).strip().lower()
    match = _DEVICE_PATTERN.match(text)
    if match is None or (match.group(1) == "cpu" and match.group(2) not in (None, "0")):
        raise UnknownDevice(f"{operation}: device {str(device)!r} is not supported; use 'cpu', 'cuda' or 'cuda:N'")
    if match.group(1) == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    if count == 0:
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
        raise UnknownDevice(
            f"{operation}: device {text!r} was asked for but CUDA is not available here (torch {torch.__version__}, "
            f"{built}, no GPU visible); use device 'cpu' (NTK_DEVICE=cpu), or install a CUDA build of torch on a "
            "machine with an NVIDIA GPU and driver"
        )
    if match.group(2) is None:
        index = torch.cuda.current_device() if cuda_devices is None else 0
    else:
        index = int(match.group(2))
    if index >= count:
        raise UnknownDevice(
            f"{operation}: device {text!r} does not exist: {count} CUDA device(s) visible "
            f"(cuda:0 to cuda:{count - 1}); check CUDA_VISIBLE_DEVICES or pick one of those"
        )
    return torch.device("cuda", index)


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (``cpu`` for a model without tensors, or for something
    that is not a module: ``compute_ntk`` refuses that with its own message)."""
    if not isinstance(model, nn.Module):
        return torch.device("cpu")
    stack = [model]  # modules in ``modules()`` order, without its generators: ~8x faster, and it runs every call
    while stack:
        module = stack.pop()
        for t in itertools.chain(module._parameters.values(), module._buffers.values()):
            if t is not None:
                return t.device
        stack.extend(m for m in reversed(module._modules.values()) if m is not None)
    return torch.device("cpu")


def place_module(module: nn.Module, device: torch.device) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are copies on ``device``; ``module`` is untouched.

    ``Module.to`` would move the shared tensors of a structural copy in place (``param.data = ...``), i.e. move
    the caller's model; this copies the tree with every tensor replaced by its copy on the device (tied weights
    stay tied). The copy keeps the module's training flags.

    Raises:
        UnsupportedModel: the module holds something that cannot be copied (a lock, a file); move it yourself
            with ``model.to(device)`` and pass it again.
    """
    memo: dict[int, object] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to(device, copy=True), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = b.detach().to(device, copy=True)
    try:
        return copy.deepcopy(module, memo)
    except Exception as exc:
        raise UnsupportedModel(
            f"compute_ntk: the model cannot be copied to {device} ({type(exc).__name__}: {exc}); move it there "
            "yourself with model.to(device) and pass that model"
        ) from exc


BUDGET_REFRESH_SECONDS = 0.5
"""How long ``default_memory_budget`` reuses its reading: /proc/meminfo costs ~0.15 ms on a cold cache, a
noticeable share of a small kernel, and what is available does not move much within half a second."""

_budget_reading: tuple[float, int] = (-math.inf, 0)  # (time.monotonic() of the reading, budget)


def default_memory_budget() -> int:
    """``DEFAULT_MEMORY_FRACTION`` of MemAvailable (Linux), else of physical memory, plus the memory malloc keeps
    free for this process (``allocator.free_heap_bytes``); read at most every ``BUDGET_REFRESH_SECONDS``."""
    global _budget_reading
    now = time.monotonic()
    read_at, budget = _budget_reading
    if now - read_at < BUDGET_REFRESH_SECONDS:
        return budget
    # memory malloc keeps free for this process is reusable by it, though MemAvailable counts it as used
    budget = int((_available_bytes() + free_heap_bytes()) * DEFAULT_MEMORY_FRACTION)
    _budget_reading = (now, budget)
    return budget


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


BudgetSource = Callable[[torch.device], int]
"""A device's default memory budget in bytes, read now (see NOTE [device budgets])."""


def host_memory_budget(device: torch.device) -> int:
    """The host budget: ``default_memory_budget()`` (half of MemAvailable, re-read every 0.5 s)."""
    return default_memory_budget()


def cuda_memory_budget(device: torch.device) -> int:
    """``CUDA_MEMORY_FRACTION`` of what this process can still allocate on a CUDA ``device``: the driver's free
    memory plus the caching allocator's reserved-but-unused bytes (NOTE [device budgets])."""
    free, _total = torch.cuda.mem_get_info(device)
    idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int((free + idle) * CUDA_MEMORY_FRACTION)


MEMORY_BUDGETS: Mapping[str, BudgetSource] = MappingProxyType({"cpu": host_memory_budget, "cuda": cuda_memory_budget})
"""The budget source per device kind (``torch.device.type``)."""


def device_memory_budget(device: torch.device, *, sources: Mapping[str, BudgetSource] = MEMORY_BUDGETS) -> int:
    """The default memory budget for a kernel on ``device``, from the source of its kind.

    Args:
        device (torch.device): where the kernel runs.
        sources (mapping): budget source per device kind. Default: ``MEMORY_BUDGETS``.

    Returns:
        int: bytes.

    Raises:
        UnknownDevice: no source for this kind of device.
    """
    source = sources.get(device.type)
    if source is None:
        raise UnknownDevice(f"compute_ntk: no memory budget is known for device {str(device)!r}; use 'cpu' or 'cuda'")
    return int(source(device))


class Tf32Policy:
    """Sets torch's process-wide TF32 switches for CUDA computations and restores them after the last one
    (NOTE [TF32]). Computations asking the same setting overlap; one asking the other waits its turn.

    Args:
        switches (list of (object, str)): the attributes to set, as (namespace, name). Default: the cuBLAS matmul
            and cuDNN switches.
    """

    def __init__(self, switches: list[tuple[object, str]] | None = None) -> None:
        self._switches = switches or [(torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32")]
        self._cond = threading.Condition()
        self._allow: bool | None = None
        self._users = 0
        self._saved: list[object] = []

    @contextlib.contextmanager
    def __call__(self, allow_tf32: bool) -> Iterator[None]:
        """Run the block with TF32 allowed or not."""
        with self._cond:
            self._cond.wait_for(lambda: self._users == 0 or self._allow == allow_tf32)
            if self._users == 0:
                self._saved = [getattr(ns, name) for ns, name in self._switches]
                for ns, name in self._switches:
                    setattr(ns, name, allow_tf32)
                self._allow = allow_tf32
            self._users += 1
        try:
            yield
        finally:
            with self._cond:
                self._users -= 1
                if self._users == 0:
                    for (ns, name), value in zip(self._switches, self._saved, strict=True):
                        setattr(ns, name, value)
                    self._allow = None
                    self._cond.notify_all()


tf32_policy = Tf32Policy()
"""The process's TF32 policy; ``compute_ntk`` enters it for CUDA computations only (no lock on the CPU)."""
