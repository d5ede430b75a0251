"""The one exception tree of ntk-service (no torch, no fastapi: the client imports it too).

Every error carries a snake_case ``error_type`` (the ``type`` field of the wire error body) and the HTTP status it
maps to. The server translates these once, in ``server/error_responses.py``; the client maps an error body back to
the same class, so ``except MemoryEstimateExceeded`` works on both sides of the wire.

    NtkServiceError
    ├── InvalidInput                      422  the values are wrong (shapes, NaN, unknown names); a ValueError
    │   ├── ShapeMismatch                 422
    │   ├── NonFiniteInput                422
    │   ├── EmptyBatch                    422
    │   ├── UnknownMode                   422
    │   ├── UnknownImplementation         422
    │   ├── NoMatchingParameters          422
    │   ├── UnsupportedModel              422  BatchNorm in train mode, examples that interact, ...
    │   ├── UnknownLayer                  422  a ``layer`` that is not a module of the model
    │   ├── OverlappingGroups             422  a parameter in two groups of ``compute_ntk_groups``
    │   ├── UnstableLearningRate          422  gradient descent above the stable limit (message gives it)
    │   ├── IncompatibleCheckpoint        422  weights that do not fit the model (names, shapes)
    │   └── UnknownDevice                 422  not 'cpu', 'cuda' or 'cuda:N', or a CUDA device that is absent
    ├── MalformedRequest                  400  the body cannot be parsed at all
    ├── UnsupportedMediaType              415
    ├── NotAcceptable                     406  e.g. a JSON response over the size cap
    ├── AuthenticationError               401
    ├── PermissionDenied                  403
    ├── NotFound                          404
    │   ├── ModelNotFound
    │   ├── DatasetNotFound
    │   ├── JobNotFound
    │   └── ResultNotFound                a job whose result was deleted (its record kept)
    ├── Conflict                          409
    │   ├── NameConflict
    │   └── JobNotFinished
    ├── ResourceLimit                     413
    │   ├── PayloadTooLarge
    │   ├── MemoryEstimateExceeded        carries estimate_bytes and budget_bytes
    │   └── DiskEstimateExceeded          carries estimate_bytes and budget_bytes
    ├── Busy                              429  carries retry_after_s
    ├── ServiceUnavailable                503  carries retry_after_s
    ├── OptionalDependencyMissing         501  e.g. the Ray executor without `ntk-service[ray]`
    └── JobFailed                         500  a job's own computation failed (its message says why)

Messages start with the operation, then say what was expected, what came, and how to fix it, e.g.
``compute_ntk: x2 has per-example shape (3,), x1 has (784,); both sides must match``.

NOTE [operation names]: the operation is named once, where it is known: at the boundary of a public call
(``compute_ntk``) or of a request (a route: "ntk of model 'm'"). Code beneath raises its error with
``detail=`` (the message without the operation) and :func:`operation_name` around the call adds the operation to
every such error that leaves it, once (the innermost boundary names it; an error raised with a whole ``message``
is never renamed). Nothing is threaded through the call chain and nothing is process-wide: the boundary is a
``with`` block in the call that owns the name::

    with operation_name(f"ntk of model {name!r}"):
        ...                                   # raise InvalidInput(detail="x1 has 3 features, ...") anywhere below
    # InvalidInput("ntk of model 'm': x1 has 3 features, ...")
"""

from __future__ import annotations

import contextlib

__all__ = [
    "AuthenticationError",
    "Busy",
    "Conflict",
    "DatasetNotFound",
    "DiskEstimateExceeded",
    "EmptyBatch",
    "IncompatibleCheckpoint",
    "InvalidInput",
    "JobFailed",
    "JobNotFinished",
    "JobNotFound",
    "MalformedRequest",
    "MemoryEstimateExceeded",
    "ModelNotFound",
    "NameConflict",
    "NoMatchingParameters",
    "NonFiniteInput",
    "NotAcceptable",
    "NotFound",
    "NtkServiceError",
    "OptionalDependencyMissing",
    "OverlappingGroups",
    "PayloadTooLarge",
    "PermissionDenied",
    "ResourceLimit",
    "ResultNotFound",
    "ServiceUnavailable",
    "ShapeMismatch",
    "UnknownDevice",
    "UnknownImplementation",
    "UnknownLayer",
    "UnknownMode",
    "UnsupportedMediaType",
    "UnstableLearningRate",
    "UnsupportedModel",
    "error_class_for",
    "format_bytes",
    "operation_name",
    "operation_part",
]


class NtkServiceError(Exception):
    """Base of every error the package raises on purpose.

    Args:
        message (str): the whole message, starting with its operation.
        detail (str, optional): instead of ``message``: the message without its operation, which the boundary of
            the operation adds (NOTE [operation names]). Until then the message is the detail alone.

    Attributes:
        message (str): the message as it stands. operation (str | None): the operation a boundary named, or None.
    """

    error_type: str = "ntk_service_error"
    http_status: int = 500

    def __init__(self, message: str = "", *, detail: str | None = None) -> None:
        text = message if detail is None else detail
        super().__init__(text)
        self.message = text
        self.operation: str | None = None
        self._named = detail is None

    def name_operation(self, operation: str) -> None:
        """Start the message with ``operation`` if it was raised without one (``detail=``); once only."""
        if self._named:
            return
        self.message = f"{operation}: {self.message}"
        self.args = (self.message,)
        self.operation = operation
        self._named = True

    def add_part(self, part: str) -> None:
        """Put ``part`` (a side, a field) in front of a detail, which stays a detail (``operation_part``)."""
        if not self._named:
            self.message = f"{part}: {self.message}"
            self.args = (self.message,)

    def leave_operation(self, *, drop: str = "") -> NtkServiceError:
        """Make the message a detail its boundary names (NOTE [operation names]), with ``drop`` removed from its
        start: for an error of code that starts its messages with a name it is given (the wire codecs' "body: ",
        or ``operation=""`` whose messages start ": ", dropped). Returns the error itself, to re-raise."""
        self.message = self.message.removeprefix(drop) if drop else self.message
        self.args = (self.message,)
        self._named = False
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class _Boundary(contextlib.AbstractContextManager[None]):
    """The ``with`` block of :func:`operation_name` (or, with ``part``, of :func:`operation_part`)."""

    def __init__(self, name: str, *, part: bool = False) -> None:
        self.name = name
        self.part = part

    def __exit__(self, kind: object, exc: BaseException | None, traceback: object) -> None:
        if isinstance(exc, NtkServiceError):
            if self.part:
                exc.add_part(self.name)
            else:
                exc.name_operation(self.name)


def operation_name(operation: str | None) -> contextlib.AbstractContextManager[None]:
    """The boundary of an operation: every ``NtkServiceError`` raised inside without its operation leaves with
    ``operation`` at the start of its message (NOTE [operation names]). None: no boundary (the caller's names it).
    """
    return contextlib.nullcontext() if operation is None else _Boundary(operation)


def operation_part(part: str) -> contextlib.AbstractContextManager[None]:
    """A part of an operation (a side, a field): every detail raised inside gets ``part: `` in front and stays a
    detail, so the operation's boundary still names it (``op: part: detail``; NOTE [operation names])."""
    return _Boundary(part, part=True)


class InvalidInput(NtkServiceError, ValueError):
    """The request is well formed but its values are wrong.

    Also a ``ValueError``, what torch.func and neural-tangents raise for bad arguments, so a caller's
    ``except ValueError`` catches it and every subclass (ShapeMismatch, UnknownMode, ...).
    """

    error_type = "invalid_input"
    http_status = 422


class ShapeMismatch(InvalidInput):
    error_type = "shape_mismatch"


class NonFiniteInput(InvalidInput):
    error_type = "non_finite_input"


class EmptyBatch(InvalidInput):
    error_type = "empty_batch"


class UnknownMode(InvalidInput):
    error_type = "unknown_mode"


class UnknownImplementation(InvalidInput):
    error_type = "unknown_implementation"


class NoMatchingParameters(InvalidInput):
    error_type = "no_matching_parameters"


class UnsupportedModel(InvalidInput):
    """The model cannot be treated example by example (train-mode BatchNorm, interacting examples, ...)."""

    error_type = "unsupported_model"


class UnknownLayer(InvalidInput):
    """A named layer (``compute_nngp(layer=...)``) is not a module of the model."""

    error_type = "unknown_layer"


class OverlappingGroups(InvalidInput):
    """A parameter is matched by two groups of ``compute_ntk_groups``: Σ_g Θ_g = Θ would count it twice."""

    error_type = "overlapping_groups"


class UnstableLearningRate(InvalidInput):
    """Gradient descent on the linearized model at a step above 2 / (c · λmax): it would diverge."""

    error_type = "unstable_learning_rate"


class IncompatibleCheckpoint(InvalidInput):
    """A checkpoint (state dict) whose parameter names or shapes are not the model's: another architecture."""

    error_type = "incompatible_checkpoint"


class UnknownDevice(InvalidInput):
    """A device string that is not 'cpu', 'cuda' or 'cuda:N', or a CUDA device this machine does not have."""

    error_type = "unknown_device"


class MalformedRequest(NtkServiceError):
    error_type = "malformed_request"
    http_status = 400


class UnsupportedMediaType(NtkServiceError):
    error_type = "unsupported_media_type"
    http_status = 415


class NotAcceptable(NtkServiceError):
    error_type = "not_acceptable"
    http_status = 406


class AuthenticationError(NtkServiceError):
    error_type = "unauthenticated"
    http_status = 401


class PermissionDenied(NtkServiceError):
    error_type = "permission_denied"
    http_status = 403


class NotFound(NtkServiceError):
    error_type = "not_found"
    http_status = 404


class ModelNotFound(NotFound):
    error_type = "model_not_found"


class DatasetNotFound(NotFound):
    error_type = "dataset_not_found"


class JobNotFound(NotFound):
    error_type = "job_not_found"


class ResultNotFound(NotFound):
    error_type = "result_not_found"


class Conflict(NtkServiceError):
    error_type = "conflict"
    http_status = 409


class NameConflict(Conflict):
    error_type = "name_conflict"


class JobNotFinished(Conflict):
    error_type = "job_not_finished"


class ResourceLimit(NtkServiceError):
    error_type = "resource_limit"
    http_status = 413


class PayloadTooLarge(ResourceLimit):
    error_type = "payload_too_large"


class _EstimateExceeded(ResourceLimit):
    def __init__(
        self,
        message: str = "",
        *,
        detail: str | None = None,
        estimate_bytes: int | None = None,
        budget_bytes: int | None = None,
    ) -> None:
        super().__init__(message, detail=detail)
        self.estimate_bytes = estimate_bytes
        self.budget_bytes = budget_bytes


class MemoryEstimateExceeded(_EstimateExceeded):
    """Refused before allocating: the smallest chunking still needs more memory than the budget."""

    error_type = "memory_estimate_exceeded"


class DiskEstimateExceeded(_EstimateExceeded):
    """Refused before starting: the result would not fit the disk budget."""

    error_type = "disk_estimate_exceeded"


class Busy(NtkServiceError):
    """Over capacity right now; retry after ``retry_after_s`` seconds."""

    error_type = "busy"
    http_status = 429

    def __init__(self, message: str = "", *, detail: str | None = None, retry_after_s: float = 1.0) -> None:
        super().__init__(message, detail=detail)
        self.retry_after_s = retry_after_s


class ServiceUnavailable(Busy):
    error_type = "service_unavailable"
    http_status = 503


class OptionalDependencyMissing(NtkServiceError):
    error_type = "optional_dependency_missing"
    http_status = 501


class JobFailed(NtkServiceError):
    error_type = "job_failed"
    http_status = 500


def _all_subclasses(cls: type[NtkServiceError]) -> list[type[NtkServiceError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


def error_class_for(error_type: str, http_status: int) -> type[NtkServiceError]:
    """The most specific class for a wire error body: by ``error_type``, else by status, else the base class."""
    classes = [c for c in _all_subclasses(NtkServiceError) if not c.__name__.startswith("_")]
    for cls in classes:
        if cls.error_type == error_type:
            return cls
    for cls in classes:
        if cls.http_status == http_status:
            return cls
    return NtkServiceError


def format_bytes(n: float) -> str:
    """Human-readable size, e.g. ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
