"""``compute_ntk`` and ``compute_ntk_groups``: the public entry points of the kernel engine.

Each is a docstring, a check of its arguments and a call into ``_compute``; how to compute is one
``NtkOptions`` value (``options.py``, NOTE [loose keywords]), and which implementation runs is
``choice.py`` (NOTE [auto choice]).

Example::

    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    >>> x1, x2 = torch.randn(5, 3), torch.randn(4, 3)
    >>> compute_ntk(model, x1, x2).theta.shape                      # (N, M, k, k)
    torch.Size([5, 4, 2, 2])
    >>> compute_ntk(model, x1, mode="trace").theta.shape            # (N, N), exactly symmetric
    torch.Size([5, 5])
    >>> compute_ntk(model, x1, mode="example_diagonal").theta.shape # (N, k, k)
    torch.Size([5, 2, 2])

NOTE [device context]: off the CPU, ``compute_ntk`` runs inside ``torch.device(device)``, so every tensor the
engine creates without naming a device (block results, probes, identity bases, scratch buffers) is made on the
computing device: no allocation site names a device, and none can be missed. The mode is thread-local and costs
a Python hop per torch call, so the CPU path, where the default device is already right, does not enter it.
Module-level caches of tensors must key on the device (``structured.contraction._one``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
from collections.abc import Hashable, Sequence

import torch
from torch import nn

from ntk_service.kernels.blocks import run_blocks
from ntk_service.kernels.choice import ALGORITHMS, choose, loop_implementation
from ntk_service.kernels.derived import SUMMED_OUTPUTS_PREFIX, SummedOutputs, pseudo_key, pseudo_params
from ntk_service.kernels.groups import GroupSpec, NtkGroupsResult, ParameterGroups, parameter_groups
from ntk_service.kernels.modes import DerivedMode, KernelMode, parse_any_mode
from ntk_service.kernels.options import DEFAULT_IMPLEMENTATION, NtkOptions, Shorthands, resolve_options
from ntk_service.kernels.problem.batch import Inputs, batch_size
from ntk_service.kernels.problem.outputs import OutputPath, parse_output
from ntk_service.kernels.problem.parameter_selection import select_parameters
from ntk_service.kernels.problem.private_module import check_model
from ntk_service.kernels.runtime.allocator import retain_freed_memory
from ntk_service.kernels.runtime.device import device_memory_budget, model_device, parse_device, tf32_policy
from ntk_service.kernels.runtime.problem_pool import prepared_problem
from ntk_service.kernels.runtime.side_cache import SideCache
from ntk_service.kernels.structured import StructuredOptions
from ntk_service.kernels.types import NtkImplementation, NtkResult

__all__ = ["DEFAULT_IMPLEMENTATION", "compute_ntk", "compute_ntk_groups", "warm_up"]


def compute_ntk(
    model: nn.Module,
    x1: Inputs,
    x2: Inputs | None = None,
    *,
    mode: KernelMode | DerivedMode | str = KernelMode.FULL,
    params: Sequence[str] | None = None,
    output: str | None = None,
    options: NtkOptions | None = None,
    side_cache: SideCache | None = None,
    x1_key: Hashable | None = None,
    x2_key: Hashable | None = None,
    implementation: NtkImplementation | str | None = None,
    dtype: torch.dtype | str | None = None,
    memory_budget_bytes: int | None = None,
    device: torch.device | str | None = None,
    allow_tf32: bool | None = None,
    structured_options: StructuredOptions | None = None,
) -> NtkResult:
    """Empirical NTK Θ(x1, x2) = J(x1) J(x2)ᵀ of ``model``, J = ∂f(x)/∂θ per example, shape (k, P).

    Args:
        model (nn.Module): maps a batch (N, *input) to (N, *out); k = prod(out). Run in eval semantics
            (dropout off) and never mutated; BatchNorm in train mode is refused.
        x1 (Tensor, tuple or mapping): (N, *input), float or integer (token ids); or a tuple of such tensors
            (forward's positional arguments) or a mapping name -> tensor (keyword arguments, e.g.
            ``{"input_ids": ids, "attention_mask": mask}``), every leaf with the same N. Integer leaves are data,
            never differentiated; ids that feed an nn.Embedding are checked against its vocabulary.
        x2 (same kind as x1, optional): (M, *input), with x1's names and per-example shapes. Default: None,
            meaning x2 = x1: the x1 side is computed once and the result is exactly symmetric.
        mode (KernelMode or str): "full" (N, M, k, k), "trace" (N, M) (the plain sum over outputs;
            neural-tangents divides by k), "example_diagonal" (N, k, k), "output_diagonal" (N, M, k),
            "pseudo" (N, M): the pseudo-NTK (1/k) Σ_ab Θ_ab from one gradient per example (``family/pseudo.py``).
            Default: "full".
        params (list of str, optional): glob patterns over parameter names, e.g. ``["head.*"]``: the kernel
            of that subset only. Tied weights count once. Default: None (all parameters).
        output (str, optional): which tensor of forward's return value is f: a key or attribute name
            (``"logits"`` of a dict or a Hugging Face ``ModelOutput``) or a path with indexing, e.g.
            ``"logits[:, 0]"`` (parsed, never evaluated: ``problem/outputs.py``); k = its size per example. Default:
            None (forward returns a tensor).
        options (NtkOptions, optional): how to compute: implementation, dtype, memory budget, device, TF32 and
            the structured engine's fast paths (``options.py``). Default: None, ``NtkOptions()`` (auto, the
            model's dtype and device, half the available memory, no TF32, every fast path on).
        side_cache (SideCache, optional): reuse per-side intermediates across calls, for sides with a key.
        x1_key, x2_key (hashable, optional): keys naming the model version and the content of x1 / x2.
        implementation, dtype, memory_budget_bytes, device, allow_tf32, structured_options: shorthands for the
            ``NtkOptions`` field of that name (``structured_options``: ``structured``), e.g.
            ``compute_ntk(model, x1, implementation="structured")``. Give these or ``options``, not both
            (NOTE [loose keywords] in options.py). Default: None (not given).

    Returns:
        NtkResult: ``theta`` (N, M, k, k) FULL, (N, M) TRACE, (N, k, k) EXAMPLE_DIAGONAL, (N, M, k)
        OUTPUT_DIAGONAL, (N, M) PSEUDO, on the computing device; plus the mode, the implementation that ran and the
        memory estimate; ``per_example_loop`` when the model refused ``vmap`` over examples (NOTE [per-example
        loop] in jacobian_contraction.py).

    Raises:
        InvalidInput: bad input: UnknownMode, UnknownImplementation, ShapeMismatch, EmptyBatch, NonFiniteInput,
            NoMatchingParameters, UnsupportedModel or UnknownDevice; loose keywords given with ``options``; inputs
            with different N, names of x2 that differ from x1's, a float input that feeds an nn.Embedding, ids
            outside its vocabulary, an ``output`` path that is not in what forward returns (each naming the leaf).
        MemoryEstimateExceeded: even the smallest blocks would not fit the budget (before allocating).
    """
    kernel_mode = parse_any_mode(mode)
    path = parse_output(output)
    loose = Shorthands(implementation, dtype, memory_budget_bytes, device, allow_tf32, structured_options)
    opts = resolve_options(options, loose, operation="compute_ntk")
    device_of = model
    if kernel_mode is DerivedMode.PSEUDO:  # the TRACE kernel (k = 1) of Σ_a f_a / √k: see family/pseudo.py
        check_model(model)
        if params is not None:
            select_parameters(model, params)  # bad globs are reported in the model's own names
        model, params, path = SummedOutputs(model, path), pseudo_params(params), None
        x1_key, x2_key = pseudo_key(x1_key), pseudo_key(x2_key)
    result = _compute(model, x1, x2, kernel_mode, params, opts, side_cache, (x1_key, x2_key), device_of, output=path)
    return result if result.mode is kernel_mode else dataclasses.replace(result, mode=kernel_mode)


def compute_ntk_groups(
    model: nn.Module,
    x1: Inputs,
    x2: Inputs | None = None,
    *,
    groups: GroupSpec,
    rest: bool = False,
    mode: KernelMode | DerivedMode | str = KernelMode.FULL,
    output: str | None = None,
    options: NtkOptions | None = None,
    side_cache: SideCache | None = None,
    x1_key: Hashable | None = None,
    x2_key: Hashable | None = None,
    implementation: NtkImplementation | str | None = None,
    dtype: torch.dtype | str | None = None,
    memory_budget_bytes: int | None = None,
    device: torch.device | str | None = None,
    allow_tf32: bool | None = None,
    structured_options: StructuredOptions | None = None,
) -> NtkGroupsResult:
    """The NTK split by parameter group, Θ_g = Σ_{p ∈ g} J_p(x1) J_p(x2)ᵀ, every group from one pass of the engine.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        >>> res = compute_ntk_groups(model, torch.randn(5, 3), groups="modules", mode="trace")
        >>> {name: tuple(t.shape) for name, t in res.thetas.items()}
        {'0': (5, 5), '2': (5, 5)}

    Args:
        model, x1, x2, mode, output, options, side_cache, x1_key, x2_key: as for ``compute_ntk``; every mode,
            "pseudo" included.
        groups (dict or str): ``{"name": ["glob", ...]}`` over ``named_parameters()`` names (a tied weight
            answers to each of its names), or ``"modules"``: one group per module with parameters of its own,
            named by its ``named_modules()`` name ("<root>" for the model's own). Groups must not overlap and
            every glob must match a parameter.
        rest (bool): collect the parameters no group lists as a group "rest". Default: False: they take no part,
            as parameters outside ``compute_ntk(params=...)`` do.
        implementation, dtype, memory_budget_bytes, device, allow_tf32, structured_options: shorthands for
            ``options``, as for ``compute_ntk`` (NOTE [loose keywords] in options.py).

    Returns:
        NtkGroupsResult: ``thetas`` group name -> Θ_g in the layout of ``compute_ntk``'s theta for the mode, and
        ``stacked`` (G, *theta); Σ_g Θ_g equals ``compute_ntk`` over the grouped parameters to round-off.

    Raises:
        InvalidInput: as for ``compute_ntk``; NoMatchingParameters for a glob that matches nothing or an empty
            group, OverlappingGroups for a parameter in two groups, UnknownImplementation for
            "ntk_vector_products" (NOTE [group kernels] in family/groups.py).
        MemoryEstimateExceeded: the G results and block buffers would not fit the budget (before allocating).
    """
    kernel_mode = parse_any_mode(mode, operation="compute_ntk_groups")
    path = parse_output(output, operation="compute_ntk_groups")
    loose = Shorthands(implementation, dtype, memory_budget_bytes, device, allow_tf32, structured_options)
    opts = resolve_options(options, loose, operation="compute_ntk_groups")
    check_model(model)
    resolved = engine_groups = parameter_groups(model, groups, rest=rest)
    device_of = model
    if kernel_mode is DerivedMode.PSEUDO:  # the TRACE kernel of Σ_a f_a / √k, whose parameters gain a prefix
        model, engine_groups, path = SummedOutputs(model, path), resolved.prefixed(SUMMED_OUTPUTS_PREFIX), None
        x1_key, x2_key = pseudo_key(x1_key), pseudo_key(x2_key)
    params = [glob.escape(name) for name in engine_groups.selected()]  # exact names, as globs
    result = _compute(
        model, x1, x2, kernel_mode, params, opts, side_cache, (x1_key, x2_key), device_of, engine_groups, path
    )
    stacked = result.theta
    return NtkGroupsResult(
        thetas={name: stacked[g] for g, name in enumerate(resolved.names)},
        stacked=stacked,
        parameters=dict(zip(resolved.names, resolved.members, strict=True)),
        mode=kernel_mode,
        implementation=result.implementation,
        estimate_bytes=result.estimate_bytes,
        block_size=result.block_size,
        per_example_loop=result.per_example_loop,
    )


def _on_device(device: torch.device, allow_tf32: bool) -> contextlib.AbstractContextManager[object]:
    """Off the CPU: tensors the engine creates land on ``device``, under the TF32 policy (NOTE [device context])."""
    if device.type == "cpu":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.device(device))
    stack.enter_context(tf32_policy(allow_tf32))
    return stack


def _compute(
    model: nn.Module,
    x1: Inputs,
    x2: Inputs | None,
    mode: KernelMode | DerivedMode,
    params: Sequence[str] | None,
    options: NtkOptions,
    side_cache: SideCache | None,
    keys: tuple[Hashable | None, Hashable | None],
    device_of: nn.Module,
    groups: ParameterGroups | None = None,
    output: OutputPath | None = None,
) -> NtkResult:
    """The kernel of a checked call (PSEUDO already rewritten to the TRACE kernel of ``model``): the options
    resolved into what the engine takes, the problem prepared, the implementation chosen and its blocks run; with
    ``groups`` its theta is the stack (G, *theta) of the group kernels. ``device_of``: the caller's model, whose
    device is the default one."""
    engine_mode = KernelMode.TRACE if mode is DerivedMode.PSEUDO else mode
    dev = model_device(device_of) if options.device is None else options.device
    budget = device_memory_budget(dev) if options.memory_budget_bytes is None else options.memory_budget_bytes
    with (
        _on_device(dev, options.allow_tf32),
        prepared_problem(model, x1, x2, params=params, dtype=options.dtype, device=dev, output=output) as prepared,
    ):
        problem, x1t, x2t = prepared.problem, prepared.x1, prepared.x2
        n = batch_size(x1t)
        symmetric = x2t is None or engine_mode is KernelMode.EXAMPLE_DIAGONAL
        m = n if x2t is None else batch_size(x2t)
        kernels = 0 if groups is None else len(groups)
        implementation = loop_implementation(options.implementation, problem)
        alg, plan = choose(implementation, (problem, n, m, engine_mode, symmetric), budget, kernels, options.structured)
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


def warm_up(device: torch.device | str | None = None) -> None:
    """Prepare a long-running process for kernels on ``device`` (Default: the CPU): on the CPU keep freed memory
    (``retain_freed_memory``, NOTE [allocator]); everywhere load the engine's lazy machinery (torch.func
    transforms, the FLOP counter, the device's math libraries) with a tiny kernel.

    The first ``compute_ntk`` in a process pays a one-time import of about 1.3 s on an idle 2-core CPU (several
    seconds under load); a server calls this before it reports ready, so no request pays it.
    """
    dev = parse_device(device, operation="warm_up")
    if dev.type == "cpu":
        retain_freed_memory()  # a host malloc tweak: CPU kernels only
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
    x = torch.zeros(2, 2)
    for implementation in ALGORITHMS:
        compute_ntk(model, x, options=NtkOptions(implementation=implementation, device=dev))
