"""``NtkOptions``: how the engine computes a kernel, as one frozen value (httpx's ``Timeout`` / ``Limits``).

What a kernel is (the model, x1, x2, the mode, the parameters) stays in the call; how it is computed (the
implementation, the dtype, the memory budget, the device, TF32 and the structured engine's fast paths) is this
value, built once and handed down unchanged::

    >>> fast = NtkOptions(implementation="structured", dtype="float64", memory_budget_bytes=2**30)
    >>> compute_ntk(model, x1, options=fast)                                 # doctest: +SKIP
    >>> compute_ntk_groups(model, x1, groups="modules", options=fast)        # doctest: +SKIP
    >>> fast.replace(implementation="jacobian_contraction")                  # a changed copy

NOTE [loose keywords]: ``compute_ntk(model, x1, implementation="structured")`` still works: each loose keyword
(``implementation``, ``dtype``, ``memory_budget_bytes``, ``device``, ``allow_tf32``, ``structured_options``) is a
documented shorthand for ``options=NtkOptions(<that field>=...)``. The one rule: a call gives either loose
keywords or ``options``, never both (``InvalidInput`` naming the keywords and saying to use
``options.replace(...)``). Neither overriding the other silently is the point: a notebook that sets
``options`` once and later adds ``dtype="float64"`` to one call would otherwise get a result whose dtype depends
on a precedence rule nobody reads.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ntk_service.errors import InvalidInput, operation_name
from ntk_service.kernels.runtime.device import parse_device
from ntk_service.kernels.structured import StructuredOptions
from ntk_service.kernels.types import NtkImplementation, parse_implementation

__all__ = ["DEFAULT_IMPLEMENTATION", "DTYPES", "LOOSE_KEYWORDS", "NtkOptions", "Shorthands", "resolve_options"]

DEFAULT_IMPLEMENTATION = NtkImplementation.AUTO
"""AUTO: users get the cheapest implementation that fits without having to know the trade-offs."""

DTYPES = {"float32": torch.float32, "float64": torch.float64}
"""The compute dtypes by wire name: the engine computes in float32 or float64 only."""

LOOSE_KEYWORDS: dict[str, str] = {
    "implementation": "implementation",
    "dtype": "dtype",
    "memory_budget_bytes": "memory_budget_bytes",
    "device": "device",
    "allow_tf32": "allow_tf32",
    "structured_options": "structured",
}
"""The shorthand keywords of ``compute_ntk`` / ``compute_ntk_groups`` -> the ``NtkOptions`` field each sets."""


@dataclass(frozen=True)
class NtkOptions:
    """How to compute a kernel; every field has the default a plain ``compute_ntk(model, x1)`` uses.

    Attributes:
        implementation: "auto", "jacobian_contraction", "ntk_vector_products" or "structured" (an
            ``NtkImplementation``). Default: "auto", the cheapest by the cost model (NOTE [auto choice] in choice.py).
        dtype: ``torch.float32`` or ``torch.float64`` (or "float32" / "float64"). Default: None, the model's dtype.
        memory_budget_bytes: the engine chunks to fit this peak (a positive int). Default: None, half the memory
            available at call time on the computing device (``device.device_memory_budget``).
        device: "cpu", "cuda" or "cuda:N" (or a ``torch.device``), checked to exist when the value is built.
            Default: None, the model's device.
        allow_tf32: let float32 matmuls and convolutions on CUDA use TF32 tensor cores (NOTE [TF32] in
            runtime/device.py). Default: False.
        structured: the structured engine's fast paths (``StructuredOptions``). Default: every fast path on.

    Raises:
        InvalidInput: a field of the wrong kind (UnknownImplementation, UnknownDevice, a dtype other than float32
            or float64, a budget that is not a positive integer) when the value is built.
    """

    implementation: NtkImplementation = DEFAULT_IMPLEMENTATION
    dtype: torch.dtype | None = None
    memory_budget_bytes: int | None = None
    device: torch.device | None = None
    allow_tf32: bool = False
    structured: StructuredOptions = StructuredOptions()

    def __post_init__(self) -> None:
        # Normalised once here, so every reader of the value sees enums, torch dtypes and devices.
        set_field = object.__setattr__
        set_field(self, "implementation", parse_implementation(self.implementation))
        set_field(self, "dtype", _parse_dtype(self.dtype))
        budget = self.memory_budget_bytes
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, numbers.Real) or not budget >= 1:
                raise InvalidInput(
                    f"NtkOptions: memory_budget_bytes must be a positive number of bytes, got {budget!r}; "
                    "pass None for the default budget"
                )
            set_field(self, "memory_budget_bytes", int(budget))
        if self.device is not None:
            set_field(self, "device", parse_device(self.device, operation="NtkOptions"))
        if not isinstance(self.allow_tf32, bool):
            raise InvalidInput(f"NtkOptions: allow_tf32 must be True or False, got {self.allow_tf32!r}")
        if self.structured is None:
            set_field(self, "structured", StructuredOptions())
        elif not isinstance(self.structured, StructuredOptions):
            raise InvalidInput(
                f"NtkOptions: structured must be a StructuredOptions, got {type(self.structured).__name__}"
            )

    def replace(self, **changes: Any) -> NtkOptions:
        """These options with ``changes`` applied (field name -> value), checked as in the constructor.

        Raises:
            InvalidInput: a name that is not a field, or a value the constructor refuses.
        """
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            fields = [f.name for f in dataclasses.fields(self)]
            raise InvalidInput(f"NtkOptions.replace: unknown fields {unknown}; the fields are {fields}")
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """These options as plain JSON values: ``NtkOptions.from_json`` inverts it (job records store it).

        ``structured`` lists only the switches that differ from ``StructuredOptions()``.
        """
        default = StructuredOptions()
        return {
            "implementation": self.implementation.value,
            "dtype": None if self.dtype is None else str(self.dtype).removeprefix("torch."),
            "memory_budget_bytes": self.memory_budget_bytes,
            "device": None if self.device is None else str(self.device),
            "allow_tf32": self.allow_tf32,
            "structured": {
                f.name: getattr(self.structured, f.name)
                for f in dataclasses.fields(StructuredOptions)
                if getattr(self.structured, f.name) != getattr(default, f.name)
            },
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NtkOptions:
        """The options ``to_json`` wrote (fields left out take their defaults).

        Raises:
            InvalidInput: a key that is not a field, or a value the constructor refuses (a device this machine
                does not have included).
        """
        if not isinstance(data, Mapping):
            raise InvalidInput(f"NtkOptions.from_json: expected an object of fields, got {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise InvalidInput(f"NtkOptions.from_json: unknown fields {unknown}; the fields are {names}")
        fields = dict(data)
        switches = fields.pop("structured", None) or {}
        known = {f.name for f in dataclasses.fields(StructuredOptions)}
        if not isinstance(switches, Mapping) or set(switches) - known:
            raise InvalidInput(
                f"NtkOptions.from_json: structured must be an object of StructuredOptions fields {sorted(known)}, "
                f"got {switches!r}"[:300]
            )
        return cls(**fields, structured=StructuredOptions(**switches))


def _parse_dtype(dtype: object) -> torch.dtype | None:
    """None, or float32 / float64 as a ``torch.dtype``; raises InvalidInput otherwise."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in (torch.float32, torch.float64)):
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise InvalidInput(f"NtkOptions: dtype {dtype!r} is not supported; expected 'float32' or 'float64' (or None)")


class Shorthands(NamedTuple):
    """A call's loose keywords, in the order ``compute_ntk`` declares them (NOTE [loose keywords]); None: not given."""

    implementation: NtkImplementation | str | None
    dtype: torch.dtype | str | None
    memory_budget_bytes: int | None
    device: torch.device | str | None
    allow_tf32: bool | None
    structured_options: StructuredOptions | None


def resolve_options(options: NtkOptions | None, loose: Shorthands, *, operation: str | None = None) -> NtkOptions:
    """The options of a call from ``options`` or from its loose keywords (NOTE [loose keywords]).

    Args:
        options (NtkOptions, optional): the call's ``options=``.
        loose (Shorthands): the call's loose keywords.
        operation (str, optional): names the errors here (NOTE [operation names] in errors.py). Default: None,
            the caller's boundary names them.

    Returns:
        NtkOptions: ``options`` itself, or a value built from the loose keywords that were given.

    Raises:
        InvalidInput: loose keywords given together with ``options``, or ``options`` not an ``NtkOptions``.
    """
    given = {name: value for name, value in loose._asdict().items() if value is not None}
    if options is None:
        return NtkOptions(**{LOOSE_KEYWORDS[name]: value for name, value in given.items()})
    if isinstance(options, NtkOptions) and not given:
        return options
    with operation_name(operation):
        if not isinstance(options, NtkOptions):
            raise InvalidInput(detail=f"options must be an NtkOptions, got {type(options).__name__}")
        shown = ", ".join(f"{LOOSE_KEYWORDS[name]}=..." for name in given)
        raise InvalidInput(
            detail=f"{', '.join(sorted(given))} given together with options=; pass one or the other, "
            f"e.g. options=options.replace({shown})"
        )
