"""``compute_ntk_tiled``: a job's tiled, resumable kernel without a server, for a workstation or a SLURM node.

It runs on the same parts as the server's jobs, not a copy of them: ``plan_tiles`` cuts the kernel into tiles (the
chunks readers get), ``plan_panels`` groups them into panels (the work units, sized by the cost model), the executor
(``LocalExecutor`` or ``RayExecutor``) computes each panel and writes its tiles with ``run_panel``, and
``ResultArray`` stores them in the same result group (``result.zarr``) the server writes. Only the bookkeeping
differs: there is no SQLite here, the result's own tile ledger (``tiles/done``, written right after a panel's
chunks) says which tiles are done.

    >>> view = compute_ntk_tiled(model, x, out="kernel.zarr", mode="trace", tile_size=512)   # doctest: +SKIP
    >>> view.shape                                                                          # doctest: +SKIP
    (20000, 20000)

NOTE [tiled resume]
    Interrupted (Ctrl-C, ``kill -9``, a SLURM time limit) and called again with the same ``out``, it computes only
    the panels holding tiles the ledger does not have, and writes only those tiles; a panel cut off mid-write is
    computed again (its chunks, if written, are replaced with the same bits). The arguments that decide the bits (the
    model's weights, the data, mode, implementation, dtype, parameter globs, tile size, panel size and the memory
    budget, which fixes the engine's chunking) are stored with the result at the first call; a later call must agree
    with them (the stored memory budget and panel size are reused when none is given), so the resumed result is
    bitwise equal to an uninterrupted run with the same torch threads.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from ntk_service.errors import InvalidInput, ShapeMismatch, operation_name
from ntk_service.jobs.executors.base import Executor, JobWork, PanelOutcome
from ntk_service.jobs.executors.local import LocalExecutor
from ntk_service.jobs.executors.ray import RayExecutor
from ntk_service.jobs.panels import Panel, cost_model_panel_tiles
from ntk_service.jobs.planner import DEFAULT_TILE_SIZE, Tile, TilePlan, plan_tiles
from ntk_service.jobs.records import JobSpec
from ntk_service.jobs.results import RESULT_GROUP_NAME, ResultArray, is_half_created, result_attributes_at
from ntk_service.jobs.view import ResultView, open_result
from ntk_service.kernels import KernelSpec, NtkOptions, compute_ntk, model_device, parse_device, place_module
from ntk_service.kernels.modes import KernelMode, Outputs, parse_mode
from ntk_service.kernels.options import DTYPES
from ntk_service.kernels.problem.batch import Batch, batch_size, check_sides, leaves, take
from ntk_service.kernels.problem.outputs import parse_output, select_output
from ntk_service.kernels.types import NtkImplementation, parse_implementation

__all__ = ["compute_ntk_tiled", "module_sha256", "tensor_sha256"]

_DTYPES = ("float32", "float64")
_IN_MEMORY = "(array)"
"""The ``x1_dataset`` of a result computed from in-memory arrays (the server's results name a data-set id)."""


def module_sha256(model: nn.Module) -> str:
    """sha256 over a module's class, parameter and buffer names, dtypes, shapes and bytes (names its weights)."""
    digest = hashlib.sha256(type(model).__qualname__.encode())
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)}".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def tensor_sha256(x: torch.Tensor) -> str:
    """sha256 over a tensor's dtype, shape and bytes (names a data set)."""
    data = x.detach().cpu().contiguous()
    digest = hashlib.sha256(f"{data.dtype}:{tuple(data.shape)}".encode())
    digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class _LedgerCallbacks:
    """PanelCallbacks without a server: a panel's tiles the ledger lacks are claimed, a done panel advances the
    progress bar by its tiles."""

    def __init__(self, bar: Any, done: set[int]) -> None:
        self.bar, self.done_ids = bar, done
        self.implementations: set[str] = set()

    def claim(self, panel: Panel) -> tuple[Tile, ...]:
        return tuple(t for t in panel.tiles if t.id not in self.done_ids)

    def done(self, outcome: PanelOutcome) -> None:
        self.implementations.add(outcome.implementation)
        self.bar.update(len(outcome.tile_ids))

    def should_stop(self) -> bool:
        return False  # Ctrl-C raises KeyboardInterrupt in the tile itself; written tiles stay written


def _executor(executor: str | Executor, device: torch.device) -> tuple[Executor, bool]:
    if isinstance(executor, Executor):
        return executor, False
    if executor == "local":
        return LocalExecutor(device=device), True
    if executor == "ray":
        return RayExecutor(), True
    raise InvalidInput(f"compute_ntk_tiled: executor must be 'local', 'ray' or an Executor, got {executor!r}")


def _as_tensor(x: Any, name: str) -> torch.Tensor:
    tensor = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
    if tensor.ndim < 1 or tensor.shape[0] < 1:
        raise InvalidInput(f"compute_ntk_tiled: {name} needs shape (N, *input) with N ≥ 1, got {tuple(tensor.shape)}")
    return tensor


def compute_ntk_tiled(
    model: nn.Module,
    x1: torch.Tensor | np.ndarray | tuple[Any, ...] | Mapping[str, Any],
    x2: torch.Tensor | np.ndarray | tuple[Any, ...] | Mapping[str, Any] | None = None,
    *,
    out: str | Path,
    output: str | None = None,
    mode: KernelMode | str = KernelMode.FULL,
    tile_size: int = DEFAULT_TILE_SIZE,
    implementation: str = "auto",
    dtype: str = "float32",
    params: list[str] | None = None,
    memory_budget_bytes: int | None = None,
    panel_tiles: int | None = None,
    resume: bool = True,
    executor: str | Executor = "local",
    progress: bool = True,
    device: torch.device | str | None = None,
) -> ResultView:
    """Compute Θ(x1, x2) tile by tile into a result group on disk, resumably; no server needed.

    Args:
        model (nn.Module): the model (never mutated).
        x1: (N, *input) tensor or array, or a tuple / mapping of them (forward's positional / keyword inputs, as
            ``compute_ntk``). x2: (M, *input) of the same kind, or None for x2 = x1 (only tiles on and above the
            diagonal are computed; reads mirror the rest). Default: None.
        out (str | Path): the result group to write, e.g. ``"kernel.zarr"`` (a folder; ``xarray.open_zarr`` and
            ``zarr.open_group`` open it, ``open_result`` reads it with the symmetry).
        mode: a contracted mode (``vocabulary.CONTRACTED_MODES``), e.g. "full", "trace". Default: "full".
        tile_size (int): examples per tile side. Default: ``DEFAULT_TILE_SIZE``.
        implementation, dtype, params, output: as for ``compute_ntk``. Default: "auto", "float32", all
            parameters, None (forward returns a tensor).
        memory_budget_bytes (int | None): the engine's budget per tile. Default: the stored one when resuming,
            else the engine's default now (stored, so a resumed run chunks the same way).
        panel_tiles (int | None): tiles per panel side, the work unit (``jobs/panels.py``): one ``compute_ntk``
            call per panel, its tiles written together. Default: the stored one when resuming, else the cost
            model's (``DEFAULT_PANEL_SECONDS`` of estimated work, the panel's result within a quarter of the memory
            budget, ``PANELS_PER_WORKER`` panels per worker of the executor).
        resume (bool): continue a result already at ``out`` (it must be of the same computation, see NOTE
            [tiled resume]); False starts over and overwrites ``out``, which must then be a result of
            ``compute_ntk_tiled``, an empty folder or absent (never another folder). Default: True.
        executor: "local" (this process), "ray" (Ray tasks; a local Ray unless one is initialised), or an
            Executor. Default: "local".
        progress (bool): a progress bar (tiles/s, ETA) on stderr; silent when stderr is not a terminal.
            Default: True.
        device (torch.device | str | None): where the local executor computes ("cpu", "cuda", "cuda:N"); the
            model is copied there once (the caller's stays put), each tile's rows are moved there and each tile
            comes back to the host to be written. Ray tasks use the GPUs ``RayExecutor(num_gpus=...)`` reserves
            instead. Default: the model's device.

    Returns:
        ResultView of the whole kernel: (N, M, k, k) FULL, (N, M) TRACE, (N, M, k) OUTPUT_DIAGONAL, (N, k, k)
        EXAMPLE_DIAGONAL.

    Raises:
        InvalidInput, ShapeMismatch, UnknownMode, ...: bad arguments (found by a one-example probe before
            anything is written).
        InvalidInput: ``out`` holds a different computation (or something that is not a result) and resume=True;
            ``out`` holds something that is not a result of ``compute_ntk_tiled`` (a server job's result included)
            and resume=False.
        MemoryEstimateExceeded: one tile does not fit the memory budget even at the smallest chunks.
    """
    kernel_mode = parse_mode(mode)
    impl = parse_implementation(implementation)
    if dtype not in _DTYPES:
        raise InvalidInput(f"compute_ntk_tiled: dtype {dtype!r} is not supported; use 'float32' or 'float64'")
    t1 = _as_inputs(x1, "x1")
    t2 = None if x2 is None else _as_inputs(x2, "x2")
    if t2 is None:
        pass
    elif not isinstance(t1, torch.Tensor) or not isinstance(t2, torch.Tensor):
        t2 = check_sides(t1, t2, operation="compute_ntk_tiled")  # names, shapes and kinds of a tuple or mapping
    elif tuple(t2.shape[1:]) != tuple(t1.shape[1:]):
        raise ShapeMismatch(
            f"compute_ntk_tiled: x2 has examples of shape {tuple(t2.shape[1:])}, x1 has {tuple(t1.shape[1:])}; "
            "both sides must match"
        )
    m = None if t2 is None else batch_size(t2)
    plan = plan_tiles(n=batch_size(t1), m=m, tile_size=tile_size, mode=kernel_mode)
    path = Path(out).absolute()  # Ray workers run elsewhere (their own cwd): they get the absolute path
    if not resume:
        _check_overwritable(path)
    existing = _existing(path) if resume else None
    dev = model_device(model) if device is None else parse_device(device, operation="compute_ntk_tiled")
    runner, owned = _executor(executor, dev)
    if isinstance(model, nn.Module) and isinstance(runner, LocalExecutor) and model_device(model) != dev:
        model = place_module(model, dev)  # once for all tiles, not once per tile
    if memory_budget_bytes is None:
        stored = None if existing is None else existing.attributes.get("memory_budget_bytes")
        memory_budget_bytes = int(stored) if stored is not None else runner.memory_budget()
    with operation_name("compute_ntk_tiled"):  # what and how every panel computes, built once here
        kernel = KernelSpec(mode=kernel_mode, params=params, output=output)
    options = NtkOptions(implementation=impl, dtype=DTYPES[dtype], memory_budget_bytes=memory_budget_bytes)
    probe = compute_ntk(
        model,
        take(t1, 0, 1),
        None if t2 is None or not kernel_mode.spec.pairs else take(t2, 0, 1),
        spec=kernel,
        options=options.replace(device=dev) if isinstance(runner, LocalExecutor) else options,
    )
    # TRACE sums the outputs away; k (for the metadata) then comes from one forward pass of one example.
    summed = kernel_mode.spec.outputs is Outputs.SUM
    k = _outputs(model, t1, output) if summed else int(probe.theta.shape[-1])
    if panel_tiles is None and existing is not None:
        panel_tiles = int((existing.attributes.get("spec") or {}).get("panel_tiles", 1))
    if panel_tiles is None:
        panel_tiles = _panel_tiles(
            runner, model, take(t1, 0, 1), plan, k, impl, params, dtype, memory_budget_bytes, output
        )
    elif panel_tiles < 1:
        raise InvalidInput(f"compute_ntk_tiled: panel_tiles must be ≥ 1, got {panel_tiles}; omit it for the default")
    spec = JobSpec(
        model=type(model).__qualname__,
        version=0,
        weights_sha256=module_sha256(model),
        x1_dataset=_IN_MEMORY,
        x2_dataset=None if t2 is None else _IN_MEMORY,
        x1_sha256=inputs_sha256(t1),
        x2_sha256=None if t2 is None else inputs_sha256(t2),
        n=plan.n,
        m=plan.m,
        k=k,
        tile_size=tile_size,
        kernel=kernel,
        options=options,
        panel_tiles=panel_tiles,
    )
    if existing is not None:
        _check_same(existing, spec, path)
        array = existing
    else:
        array = ResultArray.create(path, plan=plan, k=k, dtype=dtype, attributes=spec.result_attributes())
    done = array.done_tile_ids()
    tiles = [t for t in plan.tiles if t.id not in done]
    work = JobWork(job_id=path.name, spec=spec, plan=plan, result_path=path)
    panels = [p for p in work.panels() if any(t.id not in done for t in p.tiles)]
    bar = tqdm(
        total=len(plan.tiles),
        initial=len(plan.tiles) - len(tiles),
        unit="tile",
        desc="compute_ntk_tiled",
        file=sys.stderr,
        disable=None if progress else True,  # None: tqdm disables itself when stderr is not a terminal
        smoothing=0.1,
    )
    callbacks = _LedgerCallbacks(bar, done)
    try:
        if panels:
            runner.run(work, model, t1, t2, panels, callbacks)
    finally:
        bar.close()
        if owned:
            runner.close()
    used = sorted(set(array.attributes.get("implementation_used") or []) | callbacks.implementations)
    if callbacks.implementations:
        array.update_attributes({"implementation_used": used})
    return open_result(path)


def _panel_tiles(
    runner: Executor,
    model: nn.Module,
    example: Batch,
    plan: TilePlan,
    k: int,
    implementation: NtkImplementation,
    params: list[str] | None,
    dtype: str,
    budget: int | None,
    output: str | None,
) -> int:
    return cost_model_panel_tiles(
        plan, model, example, k=k, implementation=implementation, params=params, dtype=dtype, output=output,
        memory_budget_bytes=budget, workers=runner.parallelism(),
    )  # fmt: skip


def _outputs(model: nn.Module, x1: Batch, output: str | None) -> int:
    """k: the size per example of the (selected) output, from one forward pass of one example."""
    first = take(x1, 0, 1)
    with torch.no_grad():
        if isinstance(first, torch.Tensor):
            raw = model(first)
        else:
            raw = model(*first) if isinstance(first, tuple) else model(**first)
    out = raw if isinstance(raw, torch.Tensor) and output is None else select_output(raw, parse_output(output))
    return int(out.reshape(1, -1).shape[1])


def _as_inputs(x: Any, name: str) -> Batch:
    """A tensor, or a tuple / mapping of tensors (each leaf as ``_as_tensor``), for ``compute_ntk``."""
    if isinstance(x, Mapping):
        return {key: _as_tensor(value, f"{name}[{key!r}]") for key, value in x.items()}
    if isinstance(x, tuple):  # a list stays one array-like, as before
        return tuple(_as_tensor(value, f"{name}[{i}]") for i, value in enumerate(x))
    return _as_tensor(x, name)


def inputs_sha256(x: Batch) -> str:
    """``tensor_sha256`` of a tensor; of a tuple / mapping, sha256 over each leaf's name and hash."""
    if isinstance(x, torch.Tensor):
        return tensor_sha256(x)
    digest = hashlib.sha256(type(x).__name__.encode())
    for name, leaf in leaves(x):
        digest.update(f"{name}:{tensor_sha256(leaf)}".encode())
    return digest.hexdigest()


def _refuse_server_result(path: Path) -> None:
    job_id = (result_attributes_at(path) or {}).get("job_id")
    if job_id is not None:
        raise InvalidInput(
            f"compute_ntk_tiled: out={str(path)!r} is the result of the server's job {job_id}; writing into it would "
            "corrupt that job: choose another out (open_result reads it)"
        )


def _check_overwritable(path: Path) -> None:
    """resume=False overwrites ``out``: only ever a result of compute_ntk_tiled (or nothing, or an empty folder),
    never a folder that holds anything else (Zarr's overwrite removes the whole folder)."""
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return
    if result_attributes_at(path) is None:
        raise InvalidInput(
            f"compute_ntk_tiled: out={str(path)!r} exists and is not a result of compute_ntk_tiled; resume=False "
            "would delete everything in it: choose a new out (e.g. 'kernel.zarr'), or remove it yourself"
        )
    _refuse_server_result(path)


def _existing(path: Path) -> ResultArray | None:
    if not path.exists() or (path.is_dir() and not any(path.iterdir())) or is_half_created(path):
        return None  # nothing yet, or a creation cut off before any tile could be written: create it anew
    if not (path / "zarr.json").exists() and (path / RESULT_GROUP_NAME).exists():
        raise InvalidInput(
            f"compute_ntk_tiled: {str(path)!r} is a folder holding a result; pass out={str(path / RESULT_GROUP_NAME)!r}"
        )
    _refuse_server_result(path)
    try:
        return ResultArray.open(path)
    except InvalidInput as exc:
        raise InvalidInput(
            f"compute_ntk_tiled: out={str(path)!r} exists and is not a result of compute_ntk_tiled ({exc.message}); "
            "choose another path, or pass resume=False to overwrite it"
        ) from exc


def _check_same(array: ResultArray, spec: JobSpec, path: Path) -> None:
    stored = _flat(array.attributes.get("spec") or {})
    wanted = _flat(spec.to_dict())
    differ = sorted(key for key in wanted if stored.get(key) != wanted[key])
    if differ:
        shown = ", ".join(f"{key}: stored {stored.get(key)!r}, now {wanted[key]!r}" for key in differ[:4])
        raise InvalidInput(
            f"compute_ntk_tiled: out={str(path)!r} holds a different computation ({shown}); resuming would mix "
            "two kernels: pass the same arguments, another out, or resume=False to start over"
        )


def _flat(data: Mapping[str, Any]) -> dict[str, Any]:
    """A stored spec (of this version or an earlier one, whose flat form reads the same: a result from before
    panels has a panel per tile) as one level of fields, ``kernel.mode`` beside ``tile_size``, to compare and
    name the ones that differ; what does not read as a spec is compared as it is."""
    try:
        data = JobSpec.from_dict(data).to_dict()
    except (InvalidInput, TypeError):
        return dict(data)
    flat = {key: value for key, value in data.items() if not isinstance(value, Mapping)}
    for part in ("kernel", "options"):
        flat |= {f"{part}.{key}": value for key, value in data[part].items()}
    return flat
