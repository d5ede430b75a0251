"""``KernelSpec``: *what* a call computes, as one frozen value beside ``NtkOptions`` (*how*).

The mode, the parameters, the output, the parameter groups, the layer of a feature kernel: every spelling a
caller may use ("trace" or ``KernelMode.TRACE``, a list or a tuple of globs, a dict of groups) is normalised
once, when the value is built (httpx's ``Timeout``), so everything that receives a spec reads enums, tuples and
a parsed output path and never checks them again::

    >>> spec = KernelSpec(mode="trace", params=["head.*"], output="logits[:, 0]")
    >>> spec.mode, spec.params                                  # (KernelMode.TRACE, ('head.*',))
    >>> compute_ntk(model, x1, spec=spec, options=NtkOptions(dtype="float64"))     # doctest: +SKIP
    >>> KernelSpec.from_json(spec.to_json()) == spec            # a plain JSON round trip (job records)
    True

The public functions take their old keywords too (``compute_ntk(model, x1, mode="trace")``): each is a shorthand
for the ``KernelSpec`` field of that name, and a call gives either those keywords or ``spec=``, never both (the
rule NOTE [loose keywords] in ``options.py`` states for ``NtkOptions``).

Only the form is checked here (a mode that exists, globs that are strings, an output path in the grammar); what
needs the model (a glob that matches nothing, overlapping groups, a layer that is not a module) is checked by the
engine against the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

from ntk_service.errors import InvalidInput, NoMatchingParameters, UnknownMode, operation_name
from ntk_service.kernels.modes import DerivedMode, KernelMode
from ntk_service.kernels.problem.outputs import OutputPath, parse_output

__all__ = [
    "MODES_BY_VALUE",
    "MODULE_GROUPS",
    "SPEC_KEYWORDS",
    "Groups",
    "KernelSpec",
    "SpecKeywords",
    "parse_kernel_mode",
    "refuse_fields",
    "resolve_spec",
]

MODULE_GROUPS = "modules"
"""``groups="modules"``: one group per module with parameters of its own (``compute_ntk_groups``)."""

Groups = Literal["modules"] | tuple[tuple[str, tuple[str, ...]], ...]
"""``KernelSpec.groups`` once normalised: "modules", or (name, globs) pairs in the order given."""

MODES_BY_VALUE: Mapping[str, KernelMode | DerivedMode] = MappingProxyType(
    {m.value: m for m in (*KernelMode, *DerivedMode)}
)
"""Every mode by its wire value: the enum of a value a schema has validated already is a lookup here."""

SPEC_KEYWORDS = ("mode", "params", "output", "groups", "rest", "layer")
"""The keywords of the public functions that are shorthands for ``KernelSpec`` fields (NOTE [loose keywords])."""


def parse_kernel_mode(mode: object) -> KernelMode | DerivedMode:
    """The ``KernelMode`` or ``DerivedMode`` for a member or its wire value.

    Raises:
        UnknownMode: anything else (the message lists the modes; the caller's boundary names the operation).
    """
    if isinstance(mode, KernelMode | DerivedMode):
        return mode
    found = MODES_BY_VALUE.get(mode) if isinstance(mode, str) else None
    if found is None:
        valid = ", ".join(repr(value) for value in MODES_BY_VALUE)
        raise UnknownMode(detail=f"unknown mode {mode!r}; expected one of {valid}")
    return found


def _globs(params: object) -> tuple[str, ...] | None:
    if params is None:
        return None
    if isinstance(params, str) or not isinstance(params, Sequence) or not all(isinstance(p, str) for p in params):
        raise NoMatchingParameters(detail=f"params must be a list of glob strings, got {params!r}")
    if not params:
        raise NoMatchingParameters(detail="params=[] selects nothing; pass None for all parameters")
    return tuple(params)


def _groups(groups: object) -> Groups | None:
    if groups is None or groups == MODULE_GROUPS:
        return groups  # type: ignore[return-value]  # None or "modules"
    if isinstance(groups, str):
        raise InvalidInput(
            detail=f"groups={groups!r} is not a grouping; pass {MODULE_GROUPS!r} (one group per module) or a mapping "
            '{"name": ["glob", ...]}, e.g. {"features": ["features.*"], "head": ["head.*"]}'
        )
    pairs = list(groups.items()) if isinstance(groups, Mapping) else None
    if isinstance(groups, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in groups):
        pairs = list(groups)  # the normalised form itself
    if pairs is None:
        raise InvalidInput(
            detail=f"groups must be {MODULE_GROUPS!r} or a mapping of group names to lists of parameter globs, got "
            f"{type(groups).__name__}"
        )
    if not pairs:
        raise InvalidInput(detail="groups is empty; give at least one group")
    out = []
    for name, patterns in pairs:
        if not isinstance(name, str) or not name:
            raise InvalidInput(detail=f"group names must be non-empty strings, got {name!r}")
        if isinstance(patterns, str) or not isinstance(patterns, Sequence):
            raise NoMatchingParameters(
                detail=f"group {name!r} must be a list of parameter globs, got {patterns!r}"
                + (f"; write [{patterns!r}]" if isinstance(patterns, str) else "")
            )
        if not patterns:
            raise NoMatchingParameters(detail=f"group {name!r} has no globs, so it selects nothing")
        bad = next((p for p in patterns if not isinstance(p, str) or not p), None)
        if bad is not None or not all(isinstance(p, str) for p in patterns):
            raise NoMatchingParameters(
                detail=f"group {name!r} has a glob {bad!r} that is not a non-empty string; globs look like "
                '"features.*" or "head.weight"'
            )
        out.append((name, tuple(patterns)))
    return tuple(out)


@dataclass(frozen=True)
class KernelSpec:
    """What to compute; every field has the default a plain ``compute_ntk(model, x1)`` uses.

    Attributes:
        mode: a row of ``vocabulary.MODES`` (its shape there), e.g. "full" (N, M, k, k), "trace" (N, M) or
            "pseudo" (N, M) (a ``KernelMode`` or ``DerivedMode``, or its value). Default: "full".
        params: glob patterns over parameter names (a list or tuple of str): the kernel of that subset. Default:
            None, every parameter.
        output: which tensor of forward's return value is f, e.g. ``"logits[:, 0]"`` (parsed once:
            ``output_path``). Default: None, forward returns a tensor.
        groups: ``{"name": ["glob", ...]}`` or "modules": one kernel per group (``compute_ntk_groups``); held as
            (name, globs) pairs in the order given. Default: None.
        rest: with groups, the parameters no group lists as a group "rest". Default: False.
        layer: a module name whose output gives the features of an NNGP (``compute_nngp``, ``monte_carlo_ntk``
            with kernel="nngp"). Default: None, the model's outputs.
        output_path: ``output`` parsed (not a field to set; not part of equality or the JSON form).

    Raises:
        UnknownMode, NoMatchingParameters, InvalidInput: a field of the wrong form, when the value is built.
    """

    mode: KernelMode | DerivedMode = KernelMode.FULL
    params: Sequence[str] | None = None  # a tuple once built
    output: str | None = None
    groups: Groups | None = None
    rest: bool = False
    layer: str | None = None
    output_path: OutputPath | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        set_field = object.__setattr__  # normalised once here: every reader sees enums, tuples and a parsed path
        if not isinstance(self.mode, KernelMode | DerivedMode):  # a member is normal already
            set_field(self, "mode", parse_kernel_mode(self.mode))
        set_field(self, "params", _globs(self.params))
        if self.output is not None and not isinstance(self.output, str):
            raise InvalidInput(
                detail=f"output must be a string path like 'logits[:, 0]', got {type(self.output).__name__}"
            )
        try:
            set_field(self, "output_path", parse_output(self.output, ""))
        except InvalidInput as exc:  # parse_output starts with the name it is given: the boundary's instead
            raise exc.leave_operation(drop=": ") from None
        set_field(self, "groups", _groups(self.groups))
        if not isinstance(self.rest, bool):
            raise InvalidInput(detail=f"rest must be True or False, got {self.rest!r}")
        if self.rest and self.groups is None:
            raise InvalidInput(detail="rest=True needs groups")
        if self.layer is not None and not isinstance(self.layer, str):
            raise InvalidInput(detail=f"layer must be a module name (a string), got {type(self.layer).__name__}")

    @property
    def group_mapping(self) -> dict[str, list[str]] | Literal["modules"] | None:
        """``groups`` as ``parameter_groups`` takes it: "modules", a dict name -> globs, or None."""
        groups = self.groups
        if groups is None or isinstance(groups, str):
            return groups
        return {name: list(globs) for name, globs in groups}

    def replace(self, **changes: Any) -> KernelSpec:
        """This spec with ``changes`` applied (field name -> value), normalised as in the constructor.

        Raises:
            InvalidInput: a name that is not a field, or a value the constructor refuses.
        """
        unknown = sorted(set(changes) - set(SPEC_KEYWORDS))
        if unknown:
            raise InvalidInput(f"KernelSpec.replace: unknown fields {unknown}; the fields are {list(SPEC_KEYWORDS)}")
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """The spec as plain JSON values (str, list, dict, bool, None): ``KernelSpec.from_json`` inverts it."""
        return {
            "mode": self.mode.value,
            "params": None if self.params is None else list(self.params),
            "output": self.output,
            "groups": self.group_mapping,
            "rest": self.rest,
            "layer": self.layer,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> KernelSpec:
        """The spec ``to_json`` wrote (fields left out take their defaults).

        Raises:
            InvalidInput: a key that is not a field, or a value the constructor refuses.
        """
        if not isinstance(data, Mapping):
            raise InvalidInput(f"KernelSpec.from_json: expected an object of fields, got {type(data).__name__}")
        unknown = sorted(set(data) - set(SPEC_KEYWORDS))
        if unknown:
            raise InvalidInput(f"KernelSpec.from_json: unknown fields {unknown}; the fields are {list(SPEC_KEYWORDS)}")
        return cls(**data)


_USED_BY = {
    "mode": "every function but ntk_features (whose features give every mode through feature_kernel)",
    "params": "compute_ntk, monte_carlo_ntk (kernel='ntk'), ntk_operator, dataset_operator and ntk_features",
    "output": "compute_ntk, compute_ntk_groups, compute_nngp, monte_carlo_ntk and ntk_operator",
    "groups": "compute_ntk_groups",
    "rest": "compute_ntk_groups",
    "layer": "compute_nngp and monte_carlo_ntk (kernel='nngp')",
}
"""Which public functions use each field, for the message of a function that does not."""


def refuse_fields(spec: KernelSpec, fields: Sequence[str], *, operation: str | None = None) -> None:
    """Refuse the ``fields`` of ``spec`` a function does not use when they are set (away from their defaults):
    a value that would be ignored silently is refused instead.

    Args:
        operation (str, optional): names the errors here (NOTE [operation names] in errors.py). Default: None,
            the caller's boundary names them.

    Raises:
        InvalidInput: naming the field and the functions that use it.
    """
    for name in fields:
        if getattr(spec, name) != getattr(_DEFAULT, name):
            with operation_name(operation):
                raise InvalidInput(
                    detail=f"{name}={getattr(spec, name)!r} is not used here; it is for {_USED_BY[name]}. "
                    "Leave it unset"
                )


class SpecKeywords(NamedTuple):
    """A call's loose keywords that are ``KernelSpec`` fields; None: not given (``rest``: False)."""

    mode: object = None
    params: object = None
    output: object = None
    groups: object = None
    rest: object = None
    layer: object = None


def resolve_spec(spec: KernelSpec | None, loose: SpecKeywords, *, operation: str | None = None) -> KernelSpec:
    """The spec of a call from ``spec`` or from its loose keywords (NOTE [loose keywords] in ``options.py``).

    Args:
        spec (KernelSpec, optional): the call's ``spec=``.
        loose (SpecKeywords): the call's keywords that are spec fields (a default value counts as not given).
        operation (str, optional): names the errors here (NOTE [operation names] in errors.py). Default: None,
            the caller's boundary names them.

    Returns:
        KernelSpec: ``spec`` itself, or one built from the keywords that were given.

    Raises:
        InvalidInput: keywords given together with ``spec``, ``spec`` not a ``KernelSpec``, or a keyword the
            spec refuses (UnknownMode, NoMatchingParameters, ...).
    """
    given = {name: value for name, value in loose._asdict().items() if value is not None and value is not False}
    if isinstance(spec, KernelSpec) and not given:
        return spec
    with operation_name(operation):
        if spec is None:
            return KernelSpec(**given)
        if not isinstance(spec, KernelSpec):
            raise InvalidInput(detail=f"spec must be a KernelSpec, got {type(spec).__name__}")
        if given:
            shown = ", ".join(f"{name}=..." for name in given)
            raise InvalidInput(
                detail=f"{', '.join(sorted(given))} given together with spec=; pass one or the other, "
                f"e.g. spec=spec.replace({shown})"
            )
    return spec


_DEFAULT = KernelSpec()
