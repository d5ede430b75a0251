"""Immutable records of registered models and data sets, and their public (JSON-ready) form."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

__all__ = ["DatasetRecord", "InputLeaf", "InputSpec", "ModelRecord", "ParameterInfo"]


@dataclass(frozen=True)
class ParameterInfo:
    """One parameter tensor of a model: its ``named_parameters()`` name and shape."""

    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class InputLeaf:
    """One named input of a model with several: its name, one example's shape and dtype, and for token ids the
    vocabulary (ids must be below it; None when nothing bounds them, e.g. an attention mask)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    vocab_size: int | None = None

    def to_public(self) -> dict[str, Any]:
        """``{"name", "shape", "dtype", "vocab_size"}``."""
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "vocab_size": self.vocab_size}


@dataclass(frozen=True)
class InputSpec:
    """The inputs of a model that takes several tensors, in forward's order.

    Attributes:
        kind: "mapping" (forward's keyword arguments: x is ``{name: (N, *shape)}``) or "tuple" (positional
            arguments: x is a tuple in this order; the names are forward's parameter names).
        leaves: one InputLeaf per input, in order.
    """

    kind: str
    leaves: tuple[InputLeaf, ...]

    @property
    def names(self) -> tuple[str, ...]:
        """The inputs' names, in order."""
        return tuple(leaf.name for leaf in self.leaves)

    def to_public(self) -> dict[str, Any]:
        """``{"kind", "leaves": [...]}`` (also the ``inputs`` column's JSON)."""
        return {"kind": self.kind, "leaves": [leaf.to_public() for leaf in self.leaves]}

    @classmethod
    def from_public(cls, data: dict[str, Any]) -> InputSpec:
        """The inverse of :meth:`to_public`."""
        leaves = tuple(
            InputLeaf(str(d["name"]), tuple(int(n) for n in d["shape"]), str(d["dtype"]), d.get("vocab_size"))
            for d in data["leaves"]
        )
        return cls(str(data["kind"]), leaves)


@dataclass(frozen=True)
class ModelRecord:
    """One immutable version of a registered model.

    Attributes:
        name: the model's name, ``^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$``.
        version: 1 for the seeded weights of ``register``, then 2, 3, ... per ``add_version``.
        architecture: the validated architecture dict, defaults filled in (same for every version of a model).
        seed: the seed of version 1; None for uploaded weights.
        num_params: P, the number of parameter values (tied parameters counted once).
        input_shape, input_dtype: one example's shape and dtype ("float32" or "int64").
        output_dim: k, outputs per example.
        parameters: (name, shape) in ``named_parameters()`` order.
        weights_sha256: hex sha256 of the stored safetensors file (the same bytes ``weights_bytes`` returns).
        created_at: when this version was committed (UTC): its upload time.
        label: the optional label given with the upload, e.g. "epoch 3" (None when none was given).
        inputs: the named inputs of a model taking several tensors (an exported program with several user
            inputs); None for one unnamed input (x of shape (N, *input_shape)), every model before schema 3.
            With inputs, ``input_shape``/``input_dtype`` are the first input's.
        parameter_paths: the path report made at registration (registry/paths.py: the path each parameter group
            takes in the kernel engine and why, AUTO's choice at a nominal size); the same for every version;
            None for models registered before it existed.
    """

    name: str
    version: int
    architecture: dict[str, Any]
    seed: int | None
    num_params: int
    input_shape: tuple[int, ...]
    input_dtype: str
    output_dim: int
    parameters: tuple[ParameterInfo, ...]
    weights_sha256: str
    created_at: datetime
    label: str | None = None
    inputs: InputSpec | None = None
    parameter_paths: dict[str, Any] | None = None

    @property
    def cache_key(self) -> tuple[str, int, str, str]:
        """A hashable key unique to this version's content, also across delete + re-register of the same name.

        ``(name, version)`` alone is reused when a model is deleted and registered again; use this key (with the
        data's own key) for anything cached per model version, e.g. the engine's SideCache.
        """
        return (self.name, self.version, self.weights_sha256, self.created_at.isoformat())

    def to_public(self) -> dict[str, Any]:
        """The JSON body of ``POST /v1/models`` / ``GET /v1/models/{name}``."""
        return {
            "name": self.name,
            "version": self.version,
            "architecture": self.architecture,
            "seed": self.seed,
            "num_params": self.num_params,
            "input_shape": list(self.input_shape),
            "input_dtype": self.input_dtype,
            "output_dim": self.output_dim,
            "parameters": [{"name": p.name, "shape": list(p.shape)} for p in self.parameters],
            "weights_sha256": self.weights_sha256,
            "created_at": self.created_at.isoformat(),
            "label": self.label,
            "inputs": None if self.inputs is None else self.inputs.to_public(),
            "class_name": self.architecture.get("class_name"),
            "parameter_paths": self.parameter_paths,
        }


@dataclass(frozen=True)
class DatasetRecord:
    """An uploaded data set: a (N, *example_shape) array stored as one .npy file.

    Attributes:
        id: ``ds_`` + 24 hex digits, assigned by the store.
        name: the optional name the client gave (not unique).
        shape: (N, *example_shape).
        dtype: "float32", "float64" or "int64".
        sha256: hex sha256 of the .npy file's bytes.
        size_bytes: size of the .npy file.
        created_at: when it was committed (UTC).
    """

    id: str
    name: str | None
    shape: tuple[int, ...]
    dtype: str
    sha256: str
    size_bytes: int
    created_at: datetime

    def to_public(self) -> dict[str, Any]:
        """The JSON body of ``POST /v1/datasets`` / ``GET /v1/datasets/{id}``."""
        return {
            "id": self.id,
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "sha256": self.sha256,
            "size_bytes": self.size_bytes,
            "created_at": self.created_at.isoformat(),
        }
