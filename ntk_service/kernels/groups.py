"""Parameter groups for the per-layer decomposition Θ = Σ_g Θ_g (``compute_ntk_groups``).

The NTK is a sum over parameters: Θ(x1, x2) = Σ_p J_p(x1) J_p(x2)ᵀ. A partition of the parameters into groups
(layers, blocks, "backbone" and "head") splits it into one kernel per group, Θ_g = Σ_{p ∈ g} J_p J_pᵀ, whose sum
is the kernel of all the grouped parameters. The engine forms per-parameter terms anyway, so it adds each term
into its group's accumulator instead of a single one: the Jacobians (or factors) are built once for all groups.

A grouping is given as ``{"name": ["glob", ...]}`` over ``named_parameters()`` names (``fnmatch``, as for
``compute_ntk(params=...)``; a tied weight answers to each of its names and counts once), or as ``"modules"``:
one group per module that has parameters of its own, named by its ``named_modules()`` name (``ROOT_GROUP`` for the
model itself). Groups must not overlap, every glob must match a parameter, and parameters that no group lists are
left out unless ``rest=True`` collects them as a group ``REST_GROUP``.

NOTE [group kernels]: per implementation, where the per-parameter terms are summed:

- jacobian_contraction: J is built per parameter tensor anyway; each tensor's product goes into its group's
  accumulator (``contract_groups``): the same FLOPs as one kernel, G accumulators instead of one.
- structured: every factored term, rule Jacobian and fallback Jacobian belongs to one parameter (a weight with
  its folded bias: both must be in the group, else the bias part Σ δ1·δ2 is added on its own into the bias's
  group), so the same sides serve all groups; the sequential chain's terms are factored terms too.
- ntk_vector_products: never builds J nor any per-parameter term (Θ·e by one JVP of a VJP over all parameters at
  once), so it has no one-pass split; G restricted passes would cost G kernels, which ``compute_ntk(params=...)``
  per group already does. It is refused by name (``UnknownImplementation``) and AUTO chooses among the others.

Memory: the sides are shared, but the G results and each block's G accumulators are held at once, so the planner
counts the result and the block contraction G times (``plan_blocks(groups=G)``) and refuses up front, with that
estimate, what does not fit.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from ntk_service.errors import InvalidInput, NoMatchingParameters, OverlappingGroups
from ntk_service.kernels.modes import DerivedMode, KernelMode
from ntk_service.kernels.types import NtkImplementation

__all__ = [
    "MODULE_GROUPS",
    "REST_GROUP",
    "ROOT_GROUP",
    "GroupSpec",
    "NtkGroupsResult",
    "ParameterGroups",
    "parameter_groups",
]

MODULE_GROUPS = "modules"
"""``groups="modules"``: one group per module with parameters of its own (``named_parameters(recurse=False)``)."""

REST_GROUP = "rest"
"""The group of the parameters no group lists, with ``rest=True``."""

ROOT_GROUP = "<root>"
"""The name of the model's own direct parameters under ``groups="modules"`` (its ``named_modules()`` name is "")."""

GroupSpec = Mapping[str, Sequence[str]] | str
"""``{"group name": ["glob", ...]}`` or ``"modules"``."""


@dataclass(frozen=True)
class ParameterGroups:
    """A partition of the selected parameters into named groups.

    Attributes:
        names: the group names, in the order given (``"modules"``: ``named_modules()`` order; ``REST_GROUP`` last).
        members: per group, its parameters' canonical names (the first of a tied weight's names), in
            ``named_parameters()`` order.
    """

    names: tuple[str, ...]
    members: tuple[tuple[str, ...], ...]

    def __len__(self) -> int:
        return len(self.names)

    @cached_property
    def index(self) -> dict[str, int]:
        """Parameter name -> the index of its group."""
        return {name: g for g, group in enumerate(self.members) for name in group}

    def selected(self) -> list[str]:
        """Every grouped parameter, group by group."""
        return [name for group in self.members for name in group]

    def prefixed(self, prefix: str) -> ParameterGroups:
        """The same groups with every parameter name prefixed (the parameters of a wrapping module)."""
        return ParameterGroups(self.names, tuple(tuple(prefix + name for name in group) for group in self.members))


def _aliases(module: nn.Module) -> list[tuple[str, str]]:
    """(name, canonical name) for every name of every parameter, tied weights under each of their names."""
    canonical: dict[int, str] = {}
    out = []
    for name, p in module.named_parameters(remove_duplicate=False):
        out.append((name, canonical.setdefault(id(p), name)))
    return out


def _module_groups(module: nn.Module) -> dict[str, list[str]]:
    """One group per module with direct parameters; a tied weight goes to the first module holding it."""
    canonical = {id(p): name for name, p in reversed(list(module.named_parameters(remove_duplicate=False)))}
    taken: set[str] = set()
    groups: dict[str, list[str]] = {}
    for qualified, sub in module.named_modules():
        own = [canonical[id(p)] for _, p in sub.named_parameters(recurse=False)]
        own = [name for name in own if name not in taken]
        if own:
            taken.update(own)
            groups[qualified or ROOT_GROUP] = own
    return groups


def _check_spec(groups: object, operation: str) -> Mapping[str, Sequence[str]]:
    if isinstance(groups, str):
        raise InvalidInput(
            f"{operation}: groups={groups!r} is not a grouping; pass {MODULE_GROUPS!r} (one group per module) or "
            'a mapping {"name": ["glob", ...]}, e.g. {"features": ["features.*"], "head": ["head.*"]}'
        )
    if not isinstance(groups, Mapping):
        raise InvalidInput(
            f"{operation}: groups must be {MODULE_GROUPS!r} or a mapping of group names to lists of parameter "
            f"globs, got {type(groups).__name__}"
        )
    if not groups:
        raise InvalidInput(f"{operation}: groups is empty; give at least one group")
    for name, patterns in groups.items():
        if not isinstance(name, str) or not name:
            raise InvalidInput(f"{operation}: group names must be non-empty strings, got {name!r}")
        if isinstance(patterns, str) or not isinstance(patterns, Sequence):
            raise NoMatchingParameters(
                f"{operation}: group {name!r} must be a list of parameter globs, got {patterns!r}"
                + (f"; write [{patterns!r}]" if isinstance(patterns, str) else "")
            )
        if not patterns:
            raise NoMatchingParameters(f"{operation}: group {name!r} has no globs, so it selects nothing")
        bad = next((p for p in patterns if not isinstance(p, str) or not p), None)
        if bad is not None or any(not isinstance(p, str) for p in patterns):
            raise NoMatchingParameters(
                f"{operation}: group {name!r} has a glob {bad!r} that is not a non-empty string; "
                'globs look like "features.*" or "head.weight"'
            )
    return groups


def parameter_groups(
    module: nn.Module, groups: GroupSpec, *, rest: bool = False, operation: str = "compute_ntk_groups"
) -> ParameterGroups:
    """Resolve a grouping against ``module``'s parameters.

    Args:
        module: the model.
        groups: ``{"name": ["glob", ...]}`` over parameter names, or ``"modules"``.
        rest: add a group ``REST_GROUP`` of the parameters no group lists. Default: False (they are left out,
            as with ``compute_ntk(params=...)``).
        operation: the name error messages start with.

    Returns:
        The ParameterGroups.

    Raises:
        NoMatchingParameters: a glob matches no parameter (the message lists the names), a group is empty, a glob
            is not a string, the model has no parameters, or ``rest`` finds nothing left.
        OverlappingGroups: a parameter is matched by two groups (the message names it and both groups).
        InvalidInput: ``groups`` is neither a mapping nor ``"modules"``, a group name is empty, or a group is
            called ``REST_GROUP`` while ``rest`` is set.
    """
    aliases = _aliases(module)
    if not aliases:
        raise NoMatchingParameters(f"{operation}: the model has no parameters, so its NTK is zero-dimensional")
    order = {name: i for i, name in enumerate(dict.fromkeys(c for _, c in aliases))}
    if isinstance(groups, str) and groups == MODULE_GROUPS:
        spec: dict[str, list[str]] = _module_groups(module)
    else:
        checked = _check_spec(groups, operation)
        spec = {}
        owner: dict[str, str] = {}
        for group, patterns in checked.items():
            spec[group] = []
            for pattern in patterns:
                hits = [(alias, c) for alias, c in aliases if fnmatch.fnmatchcase(alias, pattern)]
                if not hits:
                    known = list(order)
                    shown = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
                    raise NoMatchingParameters(
                        f"{operation}: glob {pattern!r} of group {group!r} matches no parameter; the model has: {shown}"
                    )
                for alias, c in hits:
                    first = owner.setdefault(c, group)
                    if first != group:
                        also = "" if alias == c else f" (as {alias!r})"
                        raise OverlappingGroups(
                            f"{operation}: parameter {c!r}{also} is in both group {first!r} and group {group!r}; "
                            "groups must not overlap, so that the group kernels add up to the kernel"
                        )
                    if c not in spec[group]:
                        spec[group].append(c)
    if rest:
        if REST_GROUP in spec:
            raise InvalidInput(
                f"{operation}: a group is called {REST_GROUP!r} and rest=True would add another; rename the group"
            )
        grouped = {name for members in spec.values() for name in members}
        left = [name for name in order if name not in grouped]
        if not left:
            raise NoMatchingParameters(
                f"{operation}: rest=True, but every parameter is already in a group, so {REST_GROUP!r} would be empty"
            )
        spec[REST_GROUP] = left
    names = tuple(spec)
    return ParameterGroups(names, tuple(tuple(sorted(spec[g], key=order.__getitem__)) for g in names))


@dataclass(frozen=True)
class NtkGroupsResult:
    """What ``compute_ntk_groups`` returns.

    Attributes:
        thetas: group name -> Θ_g, each shaped like ``compute_ntk``'s theta for the mode (``ModeSpec.shape``,
            e.g. (N, M, k, k) FULL), views of ``stacked``.
        stacked: (G, *theta) every group's kernel, in the order of ``thetas``.
        parameters: group name -> its parameters (canonical names, ``named_parameters()`` order).
        mode: the mode computed.
        implementation: the implementation that ran (never AUTO).
        estimate_bytes: the planned peak memory, all G results included.
        block_size: examples per block along N and M (N when unchunked).
        per_example_loop: as ``NtkResult.per_example_loop``.
    """

    thetas: dict[str, torch.Tensor]
    stacked: torch.Tensor
    parameters: dict[str, tuple[str, ...]]
    mode: KernelMode | DerivedMode
    implementation: NtkImplementation
    estimate_bytes: int
    block_size: int
    per_example_loop: bool = False

    def total(self) -> torch.Tensor:
        """Σ_g Θ_g: the kernel of every grouped parameter (``compute_ntk`` with those parameters, to round-off)."""
        return self.stacked.sum(0)
