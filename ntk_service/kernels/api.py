"""``compute_ntk`` and ``compute_ntk_groups``: the public entry points of the kernel engine.

Each is a docstring, a check of its arguments and one call into the core (``core.py``): what to compute is one
``KernelSpec`` (``spec.py``), how to compute is one ``NtkOptions`` (``options.py``, NOTE [loose keywords]), each
given as ``spec=`` / ``options=`` or by its loose keywords; which implementation runs is ``choice.py`` (NOTE [auto
choice]).

Example::

    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    >>> x1, x2 = torch.randn(5, 3), torch.randn(4, 3)
    >>> compute_ntk(model, x1, x2).theta.shape                      # (N, M, k, k)
    torch.Size([5, 4, 2, 2])
    >>> compute_ntk(model, x1, mode="trace").theta.shape            # (N, N), exactly symmetric
    torch.Size([5, 5])
    >>> compute_ntk(model, x1, mode="example_diagonal").theta.shape # (N, k, k)
    torch.Size([5, 2, 2])
    >>> compute_ntk(model, x1, spec=KernelSpec(mode="trace")).theta.shape     # the same call, as one value
    torch.Size([5, 5])
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import nn

from ntk_service.errors import InvalidInput, operation_name
from ntk_service.kernels.choice import ALGORITHMS
from ntk_service.kernels.core import run, run_kernel
from ntk_service.kernels.groups import GroupSpec, NtkGroupsResult
from ntk_service.kernels.modes import DerivedMode, KernelMode
from ntk_service.kernels.options import DEFAULT_IMPLEMENTATION, NtkOptions, Shorthands, resolve_options
from ntk_service.kernels.problem.batch import Inputs
from ntk_service.kernels.runtime.allocator import retain_freed_memory
from ntk_service.kernels.runtime.device import parse_device
from ntk_service.kernels.runtime.side_cache import SideCache
from ntk_service.kernels.spec import KernelSpec, SpecKeywords, refuse_fields, resolve_spec
from ntk_service.kernels.structured import StructuredOptions
from ntk_service.kernels.types import NtkImplementation, NtkResult

__all__ = ["DEFAULT_IMPLEMENTATION", "compute_ntk", "compute_ntk_groups", "warm_up"]


def compute_ntk(
    model: nn.Module,
    x1: Inputs,
    x2: Inputs | None = None,
    *,
    spec: KernelSpec | None = None,
    options: NtkOptions | None = None,
    side_cache: SideCache | None = None,
    x1_key: Hashable | None = None,
    x2_key: Hashable | None = None,
    mode: KernelMode | DerivedMode | str | None = None,
    params: Sequence[str] | None = None,
    output: str | None = None,
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
        spec (KernelSpec, optional): what to compute: the mode, the parameters and the output (``spec.py``).
            Default: None, ``KernelSpec()`` or the one the loose keywords below give.
        options (NtkOptions, optional): how to compute: implementation, dtype, memory budget, device, TF32 and
            the structured engine's fast paths (``options.py``). Default: None, ``NtkOptions()`` (auto, the
            model's dtype and device, half the available memory, no TF32, every fast path on).
        side_cache (SideCache, optional): reuse per-side intermediates across calls, for sides with a key.
        x1_key, x2_key (hashable, optional): keys naming the model version and the content of x1 / x2.
        mode (KernelMode or str): shorthand for ``spec.mode``: a row of ``vocabulary.MODES`` (its shape there),
            e.g. "full" (N, M, k, k), "trace" (N, M) (the plain sum over outputs; neural-tangents divides by k),
            "example_diagonal" (N, k, k), "pseudo" (N, M): the pseudo-NTK (1/k) Σ_ab Θ_ab from one gradient per
            example (``derived.py``). Default: "full".
        params (list of str, optional): shorthand for ``spec.params``: glob patterns over parameter names, e.g.
            ``["head.*"]``: the kernel of that subset only. Tied weights count once. Default: None (all).
        output (str, optional): shorthand for ``spec.output``: which tensor of forward's return value is f: a key
            or attribute name (``"logits"`` of a dict or a Hugging Face ``ModelOutput``) or a path with indexing,
            e.g. ``"logits[:, 0]"`` (parsed, never evaluated: ``problem/outputs.py``); k = its size per example.
            Default: None (forward returns a tensor).
        implementation, dtype, memory_budget_bytes, device, allow_tf32, structured_options: shorthands for the
            ``NtkOptions`` field of that name (``structured_options``: ``structured``), e.g.
            ``compute_ntk(model, x1, implementation="structured")``. Give the shorthands of a value or the value
            (``spec`` / ``options``), not both (NOTE [loose keywords] in options.py). Default: None (not given).

    Returns:
        NtkResult: ``theta`` (N, M, k, k) FULL, (N, M) TRACE, (N, k, k) EXAMPLE_DIAGONAL, (N, M, k)
        OUTPUT_DIAGONAL, (N, M) PSEUDO, on the computing device; plus the mode, the implementation that ran and the
        memory estimate; ``per_example_loop`` when the model refused ``vmap`` over examples (NOTE [per-example
        loop] in jacobian_contraction.py).

    Raises:
        InvalidInput: bad input: UnknownMode, UnknownImplementation, ShapeMismatch, EmptyBatch, NonFiniteInput,
            NoMatchingParameters, UnsupportedModel or UnknownDevice; shorthands given with their value; a spec
            with groups (``compute_ntk_groups``) or a layer (``compute_nngp``); inputs with different N, names of
            x2 that differ from x1's, a float input that feeds an nn.Embedding, ids outside its vocabulary, an
            ``output`` path that is not in what forward returns (each naming the leaf).
        MemoryEstimateExceeded: even the smallest blocks would not fit the budget (before allocating).
    """
    with operation_name("compute_ntk"):  # NOTE [operation names] in errors.py
        what = resolve_spec(spec, SpecKeywords(mode=mode, params=params, output=output))
        loose = Shorthands(implementation, dtype, memory_budget_bytes, device, allow_tf32, structured_options)
        how = resolve_options(options, loose)
        refuse_fields(what, ("groups", "layer"))
        result = _kernel(model, x1, x2, what, how, side_cache, (x1_key, x2_key))
    assert isinstance(result, NtkResult)  # no groups: refused above
    return result


def compute_ntk_groups(
    model: nn.Module,
    x1: Inputs,
    x2: Inputs | None = None,
    *,
    groups: GroupSpec | None = None,
    rest: bool = False,
    spec: KernelSpec | None = None,
    options: NtkOptions | None = None,
    side_cache: SideCache | None = None,
    x1_key: Hashable | None = None,
    x2_key: Hashable | None = None,
    mode: KernelMode | DerivedMode | str | None = None,
    output: str | None = None,
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
        model, x1, x2, options, side_cache, x1_key, x2_key, mode, output: as for ``compute_ntk``; every mode,
            "pseudo" included.
        groups (dict or str): shorthand for ``spec.groups``: ``{"name": ["glob", ...]}`` over
            ``named_parameters()`` names (a tied weight answers to each of its names), or ``"modules"``: one group
            per module with parameters of its own, named by its ``named_modules()`` name ("<root>" for the
            model's own). Groups must not overlap and every glob must match a parameter. Required, here or in
            ``spec``.
        rest (bool): shorthand for ``spec.rest``: collect the parameters no group lists as a group "rest".
            Default: False: they take no part, as parameters outside ``compute_ntk(params=...)`` do.
        spec (KernelSpec, optional): what to compute, with ``groups`` set (``params`` is not: the groups select
            the parameters). Default: None, the one the shorthands give.
        implementation, dtype, memory_budget_bytes, device, allow_tf32, structured_options: shorthands for
            ``options``, as for ``compute_ntk`` (NOTE [loose keywords] in options.py).

    Returns:
        NtkGroupsResult: ``thetas`` group name -> Θ_g in the layout of ``compute_ntk``'s theta for the mode, and
        ``stacked`` (G, *theta); Σ_g Θ_g equals ``compute_ntk`` over the grouped parameters to round-off.

    Raises:
        InvalidInput: as for ``compute_ntk``; no groups, or a spec with params or a layer; NoMatchingParameters for
            a glob that matches nothing or an empty group, OverlappingGroups for a parameter in two groups,
            UnknownImplementation for "ntk_vector_products" (NOTE [group kernels] in groups.py).
        MemoryEstimateExceeded: the G results and block buffers would not fit the budget (before allocating).
    """
    with operation_name("compute_ntk_groups"):  # NOTE [operation names] in errors.py
        what = resolve_spec(spec, SpecKeywords(mode=mode, output=output, groups=groups, rest=rest))
        loose = Shorthands(implementation, dtype, memory_budget_bytes, device, allow_tf32, structured_options)
        how = resolve_options(options, loose)
        if what.groups is None:
            raise InvalidInput(detail='groups is required: "modules" or {"name": ["glob", ...]}')
        refuse_fields(what, ("params", "layer"))
        result = _kernel(model, x1, x2, what, how, side_cache, (x1_key, x2_key))
    assert isinstance(result, NtkGroupsResult)  # groups given: checked above
    return result


def _kernel(
    model: nn.Module,
    x1: Inputs,
    x2: Inputs | None,
    spec: KernelSpec,
    options: NtkOptions,
    side_cache: SideCache | None,
    keys: tuple[Hashable | None, Hashable | None],
) -> NtkResult | NtkGroupsResult:
    """The one call into the core both entry points make (``core.run`` with ``core.run_kernel``)."""
    return run(
        lambda call: run_kernel(model, x1, x2, call, side_cache=side_cache, keys=keys), spec, options, device_of=model
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
