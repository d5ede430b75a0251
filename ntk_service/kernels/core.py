"""The private core of the engine's public functions: a checked call, resolved once and run where it belongs.

Every public function (``compute_ntk``, ``compute_ntk_groups``, ``compute_nngp``, ``monte_carlo_ntk``,
``ntk_operator``, ``dataset_operator``, ``ntk_features``) is a docstring, a check and one call of :func:`run`
(torch.func's ``apis.py``): the check builds the two values, ``KernelSpec`` (what, ``spec.py``) and
``NtkOptions`` (how, ``options.py``), from ``spec=`` / ``options=`` or the loose keywords, and refuses what the
function cannot do; :func:`run` resolves what the values leave open (the device: the model's when
``options.device`` is None; the memory budget: the device's default when ``options.memory_budget_bytes`` is
None), enters the device context (NOTE [device context]) and hands the function's implementation a :class:`Call`.
Nothing below re-checks the spec or the options: an implementation reads them.

:func:`run_kernel` is the implementation of ``compute_ntk`` and ``compute_ntk_groups`` (and of one model's kernel
in ``monte_carlo_ntk``): a derived mode's rewrite (``derived.py``), the parameter groups, the prepared
problem, the implementation chosen and its blocks run.

NOTE [device context]: off the CPU, a call runs inside ``torch.device(device)``, so every tensor the engine
creates without naming a device (block results, probes, identity bases, scratch buffers) is made on the computing
device: no allocation site names a device, and none can be missed. The mode is thread-local and costs a Python hop
per torch call, so the CPU path, where the default device is already right, does not enter it. Module-level caches
of tensors must key on the device (``structured.contraction._one``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from ntk_service.errors import InvalidInput
from ntk_service.kernels.blocks import run_blocks
from ntk_service.kernels.choice import choose, loop_implementation
from ntk_service.kernels.derived import DERIVED_PREFIX, derived_key, derived_model, derived_params
from ntk_service.kernels.groups import NtkGroupsResult, ParameterGroups, parameter_groups
from ntk_service.kernels.modes import DerivedMode, contraction
from ntk_service.kernels.options import NtkOptions
from ntk_service.kernels.problem.batch import Inputs, batch_size
from ntk_service.kernels.problem.outputs import OutputPath
from ntk_service.kernels.problem.parameter_selection import select_parameters
from ntk_service.kernels.problem.private_module import check_model
from ntk_service.kernels.runtime.device import device_memory_budget, model_device, tf32_policy
from ntk_service.kernels.runtime.problem_pool import prepared_problem
from ntk_service.kernels.runtime.side_cache import SideCache
from ntk_service.kernels.spec import KernelSpec
from ntk_service.kernels.types import NtkResult

__all__ = ["Call", "on_model_device", "run", "run_kernel"]

T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    """A checked call, as the core hands it to an implementation.

    Attributes:
        spec: what to compute, normalised.
        options: how, normalised.
        device: where it runs: ``options.device``, or the model's device.
        budget: the memory budget in bytes: ``options.memory_budget_bytes``, or the device's default, read once.
    """

    spec: KernelSpec
    options: NtkOptions
    device: torch.device
    budget: int


def _on_device(device: torch.device, allow_tf32: bool) -> contextlib.AbstractContextManager[object]:
    """Off the CPU: tensors the engine creates land on ``device``, under the TF32 policy (NOTE [device context])."""
    if device.type == "cpu":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.device(device))
    stack.enter_context(tf32_policy(allow_tf32))
    return stack


def run(implementation: Callable[[Call], T], spec: KernelSpec, options: NtkOptions, *, device_of: object) -> T:
    """``implementation(call)`` for the checked values: the device and the budget resolved once, inside the
    device context.

    Args:
        implementation: the public function's implementation, taking the :class:`Call`.
        spec, options: the call's values, normalised by the public function's check.
        device_of: the caller's model, whose device is the default one (anything else: the CPU).
    """
    device = model_device(device_of) if options.device is None else options.device  # type: ignore[arg-type]
    budget = device_memory_budget(device) if options.memory_budget_bytes is None else options.memory_budget_bytes
    with _on_device(device, options.allow_tf32):
        return implementation(Call(spec, options, device, budget))


def on_model_device(options: NtkOptions, model: object, *, operation: str) -> None:
    """Refuse ``options.device`` for a function that computes where the model is (it keeps a private copy of the
    model, or builds one per seed, on the model's own device).

    Raises:
        InvalidInput: ``options.device`` names another device than the model's.
    """
    where = model_device(model)  # type: ignore[arg-type]
    if options.device is not None and options.device != where:
        raise InvalidInput(
            f"{operation}: options.device is {str(options.device)!r} but the model is on {str(where)!r}; "
            f"{operation} computes where the model is: move the model with model.to(device), or leave "
            "options.device None"
        )


def run_kernel(
    model: nn.Module,
    x1: Inputs,
    x2: Inputs | None,
    call: Call,
    *,
    side_cache: SideCache | None = None,
    keys: tuple[Hashable | None, Hashable | None] = (None, None),
) -> NtkResult | NtkGroupsResult:
    """The kernel of a checked call: an ``NtkResult``, or an ``NtkGroupsResult`` when ``call.spec.groups`` is set.

    A derived mode is its base mode's kernel of ``derived_model(mode, model)`` (``derived.py``; PSEUDO: the TRACE
    kernel of Σ_a f_a / √k), whose parameter names gain a prefix; the result reports the mode asked for.
    """
    spec = call.spec
    mode = spec.mode
    x1_key, x2_key = keys
    engine_model, path = model, spec.output_path
    params: Sequence[str] | None = spec.params
    groups = resolved = None
    if spec.groups is not None:
        check_model(model)
        resolved = groups = parameter_groups(model, spec.group_mapping, rest=spec.rest)  # type: ignore[arg-type]
    if isinstance(mode, DerivedMode):  # the base mode's kernel of the derived model
        check_model(model)
        if groups is not None:
            groups = groups.prefixed(DERIVED_PREFIX)
        elif params is not None:
            select_parameters(model, params)  # bad globs are reported in the model's own names
        engine_model, params, path = derived_model(mode, model, path), derived_params(params), None
        x1_key, x2_key = derived_key(x1_key, mode), derived_key(x2_key, mode)
    if groups is not None:
        params = tuple(glob.escape(name) for name in groups.selected())  # exact names, as globs
    result = _compute(engine_model, x1, x2, call, params, side_cache, (x1_key, x2_key), groups, path)
    if resolved is None:
        return result if result.mode is mode else dataclasses.replace(result, mode=mode)
    stacked = result.theta
    return NtkGroupsResult(
        thetas={name: stacked[g] for g, name in enumerate(resolved.names)},
        stacked=stacked,
        parameters=dict(zip(resolved.names, resolved.members, strict=True)),
        mode=mode,
        implementation=result.implementation,
        estimate_bytes=result.estimate_bytes,
        block_size=result.block_size,
        per_example_loop=result.per_example_loop,
    )


def _compute(
    model: nn.Module,
    x1: Inputs,
    x2: Inputs | None,
    call: Call,
    params: Sequence[str] | None,
    side_cache: SideCache | None,
    keys: tuple[Hashable | None, Hashable | None],
    groups: ParameterGroups | None,
    output: OutputPath | None,
) -> NtkResult:
    """The problem prepared, the implementation chosen and its blocks run (a derived mode already rewritten to its
    base); with ``groups`` theta is the stack (G, *theta) of the group kernels."""
    options = call.options
    engine_mode = contraction(call.spec.mode) if isinstance(call.spec.mode, DerivedMode) else call.spec.mode
    with prepared_problem(
        model, x1, x2, params=params, dtype=options.dtype, device=call.device, output=output
    ) as prepared:
        problem, x1t, x2t = prepared.problem, prepared.x1, prepared.x2
        n = batch_size(x1t)
        symmetric = x2t is None or not engine_mode.spec.pairs
        m = n if x2t is None else batch_size(x2t)
        kernels = 0 if groups is None else len(groups)
        implementation = loop_implementation(options.implementation, problem)
        plan_args = (problem, n, m, engine_mode, symmetric)
        alg, plan = choose(implementation, plan_args, call.budget, kernels, options.structured)
        theta = run_blocks(
            alg,
            problem,
            x1t,
            None if symmetric else x2t,
            engine_mode,
            plan,
            side_cache=side_cache,
            x1_key=keys[0],
            x2_key=keys[1],
            groups=groups,
        )
    return NtkResult(
        theta=theta,
        mode=engine_mode,
        implementation=alg.implementation,
        estimate_bytes=plan.estimate_bytes,
        block_size=plan.block_n,
        per_example_loop=problem.per_example_loop,
    )
