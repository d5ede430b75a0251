"""``Client``: the service's resources (models, weights, data sets, kernels) as Python methods.

Example::

    >>> import numpy as np
    >>> from ntk_service.client import Client
    >>> with Client("http://127.0.0.1:8000", api_key="...") as client:  # doctest: +SKIP
    ...     client.register_model("mlp", {"family": "mlp", "input_dim": 4, "hidden": [16], "output_dim": 3})
    ...     x1 = np.random.rand(5, 4).astype("float32")
    ...     theta = client.ntk("mlp", x1)                      # (5, 5, 3, 3)
    ...     trace = client.ntk("mlp", x1, x1[:2], mode="trace")  # (5, 2)
    ...     ds = client.upload_dataset(x1)
    ...     block = client.ntk("mlp", {"dataset": ds["id"], "start": 0, "stop": 3})  # (3, 3, 3, 3)
"""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote

import httpx
import numpy as np

from ntk_service import wire
from ntk_service._tensors import is_torch_tensor
from ntk_service.client._analysis import (
    AnalysisClient,
    JobKernelDistance,
    JobKernelSpectrum,
    KernelComparison,
    KernelSpectrum,
    LinearizedPrediction,
)
from ntk_service.client._attribution import AttributionClient
from ntk_service.client._base import _decode_json, _decode_tensors, _media
from ntk_service.client._export import InputDtype, InputShape, export_module, multipart_body
from ntk_service.client._groups import GroupsClient
from ntk_service.client._jobs import JobsClient
from ntk_service.client._kernel_family import KernelFamilyClient
from ntk_service.client._module_spec import describe_module, is_describable
from ntk_service.client._service import ServiceClient
from ntk_service.client._types import (
    DatasetInfo,
    DtypeName,
    HealthStatus,
    ImplementationName,
    KernelModeName,
    ModelInfo,
)
from ntk_service.errors import InvalidInput, NtkServiceError

__all__ = [
    "Client",
    "JobKernelDistance",
    "JobKernelSpectrum",
    "KernelComparison",
    "KernelResult",
    "KernelSpectrum",
    "LinearizedPrediction",
]

_DATASET_REF_KEYS = frozenset({"dataset", "start", "stop"})

_ACCEPT = {"safetensors": wire.MEDIA_SAFETENSORS, "npy": wire.MEDIA_NPY, "json": wire.MEDIA_JSON}

_NTK_HEADER_PREFIX = "x-ntk-"
"""Kernel metadata rides in ``X-NTK-*`` response headers when the body is a bare .npy array."""


@dataclass(frozen=True)
class KernelResult:
    """A kernel block and how it was computed.

    Attributes:
        theta: the mode's shape (``vocabulary.MODES``), e.g. (N, M, k, k) for mode "full", (N, M) for "trace",
            (N,) for "example_trace". numpy by default, torch with ``as_torch=True``.
        mode: the kernel mode's wire value.
        implementation: the implementation that actually ran (never "auto").
        model: the model's name.
        version: the model version used.
        elapsed_ms: server-side compute time in milliseconds.
        dtype: the dtype theta was computed in ("" from a server that does not say).
        note: the server's note when float64 inputs were computed in float32 (also issued as a UserWarning), or
            None.
    """

    theta: Any
    mode: KernelModeName
    implementation: ImplementationName
    model: str
    version: int
    elapsed_ms: float
    dtype: str = ""
    note: str | None = None


class Client(KernelFamilyClient, GroupsClient, JobsClient, AttributionClient, AnalysisClient, ServiceClient):
    """Synchronous client for an ntk-service server; arrays come back as numpy (torch on request).

    Args: see ``BaseClient`` (url, api_key, timeout, transport_format, max_retries, max_retry_wait_s).
    Batch jobs: ``submit_job``, ``get_job``, ``list_jobs``, ``wait``, ``job_result``, ``cancel_job`` (``_jobs.py``).
    Data attribution: ``attribute``, ``submit_attribution_features``, ``submit_attribution``, ``attribution_result``,
    ``attribution_example`` (``_attribution.py``, whose class extends the solve and features jobs' ``_solve.py``).

    Every method raises the ``ntk_service.errors`` class of the server's error (``ModelNotFound``,
    ``MemoryEstimateExceeded``, ``Busy`` after the retries, ...), with ``.http_status`` and ``.message``;
    ``ServiceUnavailable`` when the server cannot be reached.
    """

    # ---- service ----

    def health(self) -> HealthStatus:
        """``GET /healthz``: liveness (no key needed)."""
        return cast(HealthStatus, dict(self._get_json("/healthz")))

    def architectures(self) -> list[dict[str, Any]]:
        """``GET /v1/architectures``: the model families and their config fields, the layer types of ``sequential``
        (``layers``) and the operator factories this server allows (``factories`` of the ``factory`` family)."""
        return _items(self._get_json("/v1/architectures"))

    # ---- models ----

    def register_model(
        self, name: str, architecture: Mapping[str, Any], seed: int = 0, *, label: str | None = None
    ) -> ModelInfo:
        """Register a model from an architecture spec (write scope).

        Args:
            name (str): the model's unique name.
            architecture (Mapping): ``{"family": "mlp" | "cnn" | "transformer" | "sequential" | "factory", ...}``.
            seed (int): initialises the weights (version 1). Default: 0.
            label (str | None): a label for version 1. Default: none.

        Returns:
            The model record: name, version, num_params, input_shape, output_dim, parameters, ...

        Raises:
            NameConflict: the name is taken. InvalidInput: a bad architecture spec.
        """
        body: dict[str, Any] = {"name": name, "architecture": dict(architecture), "seed": seed}
        if label is not None:
            body["label"] = label
        return cast(ModelInfo, dict(self._send_json("POST", "/v1/models", body)))

    def register_module(
        self,
        name: str,
        module: Any,
        *,
        input_shape: InputShape,
        input_dtype: InputDtype = "float32",
        label: str | None = None,
    ) -> ModelInfo:
        """Register your own model with its current weights as version 1 (write scope).

        An ``nn.Sequential`` of the layers the ``sequential`` family allows (nested ``nn.Sequential`` and
        ``Residual`` included) is sent as its architecture spec (``describe_module``) plus its ``state_dict()`` in
        one safetensors request. Any other ``nn.Module`` (a class with its own forward: loops over a ModuleList,
        gates, attention) is exported here with ``torch.export.export(module.eval(), (x,),
        dynamic_shapes=<batch dynamic>)``, written with ``torch.export.save`` and uploaded to
        ``POST /v1/models/exported``; the server loads it without unpickling anything. Either way the server's
        model has the same parameter names, so ``upload_weights(name, module.state_dict())`` adds checkpoints.

        A model taking several tensors (token ids with an attention mask) gets ``input_shape`` and ``input_dtype``
        as mappings keyed like forward's keyword arguments; it is exported, and its record's ``inputs`` lists them.
        A forward returning a mapping (a Hugging Face ``ModelOutput``) is exported returning a dict of its tensors;
        kernel requests select one with ``output`` (e.g. ``"logits[:, 0]"``).

        Args:
            name (str): the model's unique name.
            module (nn.Module): the model, mapping (N, *input_shape) to a float tensor (N, *out); float32 weights.
            input_shape (Sequence[int] | Mapping[str, Sequence[int]]): one example's shape, without the batch
                dimension; or one per keyword argument, e.g. ``{"input_ids": (T,), "attention_mask": (T,)}``.
            input_dtype (str | Mapping[str, str]): "float32", or "int64" for token ids; or one per keyword
                argument (omitted names: "float32"). Default: "float32".
            label (str | None): a label for version 1, e.g. "epoch 0". Default: none.

        Returns:
            The model record of version 1 (``architecture["family"]``: "sequential" or "exported").

        Raises:
            InvalidInput: an unsupported setting of a supported layer (named by its path), torch.export failing on
                the forward (torch's message and what to do), or a spec the server refuses. UnsupportedModel: the
                exported graph calls an operator outside the server's allow-list (named). NameConflict: the name
                is taken.

        Example::

            >>> record = client.register_module("resnet", model, input_shape=(3, 32, 32), label="epoch 0")
            >>> client.upload_weights("resnet", model.state_dict(), label="epoch 1")  # version 2
            >>> client.register_module("bert", bert, input_shape={"input_ids": (16,), "attention_mask": (16,)},
            ...                        input_dtype={"input_ids": "int64", "attention_mask": "int64"})
        """
        if isinstance(input_shape, Mapping) or isinstance(input_dtype, Mapping) or not is_describable(module):
            data = export_module(module, input_shape=input_shape, input_dtype=input_dtype)
            return self.register_program(name, data, label=label)
        architecture = describe_module(module, input_shape=input_shape, input_dtype=input_dtype)
        content = _encode_weights(module.state_dict(), {"architecture": json.dumps(architecture)})
        response = self._request(
            "POST",
            "/v1/models",
            content=content,
            content_type=wire.MEDIA_SAFETENSORS,
            accept=wire.MEDIA_JSON,
            params={"name": name, "label": label},
        )
        return cast(ModelInfo, dict(_decode_json(response)))

    def register_program(
        self, name: str, program: bytes | str | PathLike[str], *, label: str | None = None
    ) -> ModelInfo:
        """Register a saved ``torch.export`` program, with the weights it was exported with as version 1 (write scope).

        What ``register_module`` uploads for a module the ``sequential`` family cannot describe, for an archive you
        wrote yourself: ``torch.export.save(torch.export.export(model.eval(), (x,), dynamic_shapes=({0:
        torch.export.Dim("batch")},)), "model.pt2")``. It goes to ``POST /v1/models/exported`` (multipart, fields
        ``name``, ``program`` and ``label``); the server loads it without unpickling anything.

        Args:
            name (str): the model's unique name.
            program (bytes | str | PathLike): the archive's bytes, or the path of the ``.pt2`` file.
            label (str | None): a label for version 1, e.g. "epoch 0". Default: none.

        Returns:
            The model record of version 1 (``architecture["family"]``: "exported").

        Raises:
            InvalidInput: the file cannot be read, or the server refuses the archive (not a zip, a pickled entry,
                sizes that do not match the bytes, more than one input or output, ...: the message says which).
            UnsupportedModel: the graph calls an operator outside the server's allow-list (named).
            NameConflict: the name is taken. PayloadTooLarge: the archive is over the server's limits.
        """
        if isinstance(program, bytes | bytearray):
            data = bytes(program)
        else:
            try:
                data = Path(program).read_bytes()
            except OSError as exc:
                raise InvalidInput(
                    f"register_program: cannot read the program file {str(program)!r} ({exc.strerror or exc}); "
                    "expected the path of an archive written by torch.export.save"
                ) from exc
        body, content_type = multipart_body({"name": name, "label": label}, {"program": ("model.pt2", data)})
        response = self._request(
            "POST", "/v1/models/exported", content=body, content_type=content_type, accept=wire.MEDIA_JSON
        )
        return cast(ModelInfo, dict(_decode_json(response)))

    def list_models(self) -> list[ModelInfo]:
        """``GET /v1/models``: every registered model's record."""
        return cast(list[ModelInfo], _items(self._get_json("/v1/models")))

    def get_model(self, name: str, version: int | None = None) -> ModelInfo:
        """One version's record (the latest by default). Raises ``ModelNotFound`` (the message lists versions)."""
        if version is None:
            return cast(ModelInfo, dict(self._get_json(f"/v1/models/{_segment(name)}")))
        return cast(ModelInfo, dict(self._get_json(f"/v1/models/{_segment(name)}/versions/{int(version)}")))

    def list_versions(self, name: str) -> list[ModelInfo]:
        """Every version's record, oldest first: version, created_at (upload time, UTC), label, weights_sha256, ...

        Raises ``ModelNotFound``."""
        return cast(list[ModelInfo], _items(self._get_json(f"/v1/models/{_segment(name)}/versions")))

    def delete_model(self, name: str) -> None:
        """Delete a model and all its versions (write scope). Raises ``ModelNotFound``."""
        self._request("DELETE", f"/v1/models/{_segment(name)}")

    def upload_weights(
        self,
        name: str,
        tensors: Mapping[str, Any] | bytes,
        metadata: Mapping[str, str] | None = None,
        *,
        label: str | None = None,
    ) -> ModelInfo:
        """Upload weights as a new immutable version of a model (write scope); one line per checkpoint::

            client.upload_weights("resnet", model.state_dict(), label=f"epoch {epoch}")

        Args:
            name (str): the model.
            tensors (Mapping[str, array] | bytes): tensor name -> array (numpy or torch), e.g. a ``state_dict()``
                with its buffers, or the bytes of a safetensors file.
            metadata (Mapping[str, str] | None): string metadata for the safetensors header. Default: none.
            label (str | None): a label for the version, e.g. "epoch 3" (1-200 printable characters).
                Default: none.

        Returns:
            The model record of the new version.

        Raises:
            InvalidInput: names, shapes or dtypes that do not match the architecture (every one named).
        """
        if isinstance(tensors, bytes | bytearray):
            content = bytes(tensors)
        else:
            content = _encode_weights(tensors, dict(metadata) if metadata else None)
        response = self._request(
            "POST",
            f"/v1/models/{_segment(name)}/versions",
            content=content,
            content_type=wire.MEDIA_SAFETENSORS,
            accept=wire.MEDIA_JSON,
            params={"label": label},
        )
        return cast(ModelInfo, dict(_decode_json(response)))

    def download_weights(self, name: str, version: int | None = None, *, as_torch: bool = False) -> dict[str, Any]:
        """The weights of one version as a ``state_dict`` (tensor name -> array), loadable with
        ``model.load_state_dict(client.download_weights(name, v, as_torch=True))``.

        Args:
            name (str): the model.
            version (int | None): the version. Default: the latest.
            as_torch (bool): return torch tensors instead of numpy arrays. Default: False.
        """
        if version is None:
            version = int(self.get_model(name)["version"])
        response = self._request(
            "GET",
            f"/v1/models/{_segment(name)}/versions/{int(version)}/weights",
            accept=wire.MEDIA_SAFETENSORS,
        )
        tensors, _ = _decode_tensors(response, npy_name="weights")
        return {key: _maybe_torch(value, as_torch) for key, value in tensors.items()}

    # ---- data sets ----

    def upload_dataset(self, array: Any, name: str | None = None) -> DatasetInfo:
        """Upload inputs once, to reference them by id and row range in kernels and jobs (write scope).

        Args:
            array: (N, *input) numpy array or torch tensor; or a mapping name -> such an array, every one with the
                same N, e.g. ``{"input_ids": ids, "attention_mask": mask}`` (sent as an .npz; names are the model's
                forward keyword arguments, ASCII identifiers).
            name (str | None): a label. Default: none.

        Returns:
            The data set record: id, shape, dtype, sha256, ...; for a mapping shape (N,), dtype "mapping" and
            ``arrays``: ``[{"name", "shape", "dtype"}, ...]``.

        Raises:
            InvalidInput: a dtype, name or shape the server refuses (422, naming the array).
        """
        if isinstance(array, Mapping):
            content, media = _encode_npz(array), wire.MEDIA_NPZ
        else:
            content, media = wire.encode_npy(_to_numpy(array, name="dataset")), wire.MEDIA_NPY
        response = self._request(
            "POST",
            "/v1/datasets",
            content=content,
            content_type=media,
            accept=wire.MEDIA_JSON,
            params={"name": name},
        )
        return cast(DatasetInfo, dict(_decode_json(response)))

    def list_datasets(self) -> list[DatasetInfo]:
        """``GET /v1/datasets``: every data set's record."""
        return cast(list[DatasetInfo], _items(self._get_json("/v1/datasets")))

    def get_dataset(self, dataset_id: str) -> DatasetInfo:
        """One data set's record. Raises ``DatasetNotFound``."""
        return cast(DatasetInfo, dict(self._get_json(f"/v1/datasets/{_segment(dataset_id)}")))

    def delete_dataset(self, dataset_id: str) -> None:
        """Delete a data set (write scope). Raises ``DatasetNotFound``."""
        self._request("DELETE", f"/v1/datasets/{_segment(dataset_id)}")

    # ---- kernels ----

    def ntk(
        self,
        model: str,
        x1: Any,
        x2: Any = None,
        *,
        mode: KernelModeName = "full",
        implementation: ImplementationName = "auto",
        params: Sequence[str] | None = None,
        dtype: DtypeName | None = None,
        version: int | None = None,
        as_torch: bool = False,
        output: str | None = None,
    ) -> Any:
        """The empirical NTK Θ(x1, x2) = J(x1) J(x2)ᵀ of a registered model.

        Args:
            model (str): the model's name.
            x1: (N, *input) numpy array, torch tensor or nested list, or a data set slice
                ``{"dataset": id, "start": i, "stop": j}`` (start/stop optional); for a model taking several
                inputs (its record's ``inputs``), a mapping of arrays or tensors keyed like them,
                ``{"input_ids": ids, "attention_mask": mask}``, each (N, ...).
            x2: (M, *input), same forms; ``None`` means x2 = x1 (computed once, exactly symmetric).
                Default: None.
            mode (str): a mode of ``vocabulary.MODE_NAMES`` ("full", "trace", ...; their shapes: docs/concepts.md,
                "Modes"). Default: "full".
            implementation (str): "auto" | "jacobian_contraction" | "ntk_vector_products" | "structured".
                Default: "auto".
            params (Sequence[str] | None): glob patterns over parameter names, e.g. ``["head.*"]``.
                Default: all parameters.
            dtype (str | None): "float32" or "float64", what theta is computed in. Default: float32 (float64
                inputs are then computed in float32, and the server's note says so: a UserWarning here).
            version (int | None): the model version. Default: the latest.
            as_torch (bool): return a torch tensor instead of a numpy array. Default: False.
            output (str | None): for a model returning a dict (a Hugging Face model's logits): the tensor the
                kernel is of, e.g. ``"logits"`` or ``"logits[:, 2, :4]"``; k is its size per example.
                Default: None (the model returns one tensor).

        Returns:
            theta: the mode's shape (``vocabulary.MODES``), e.g. (N, M, k, k) for "full", (N, M) for "trace".

        Raises:
            ModelNotFound, DatasetNotFound: no such model, version or data set (404).
            InvalidInput: bad inputs, e.g. ShapeMismatch or NonFiniteInput (422).
            MemoryEstimateExceeded: over the server's memory budget; the message carries the estimate (413).
            Busy: still over capacity after the retries (429).
        """
        result = self.ntk_result(
            model,
            x1,
            x2,
            mode=mode,
            implementation=implementation,
            params=params,
            dtype=dtype,
            version=version,
            as_torch=as_torch,
            output=output,
        )
        return result.theta

    def ntk_result(
        self,
        model: str,
        x1: Any,
        x2: Any = None,
        *,
        mode: KernelModeName = "full",
        implementation: ImplementationName = "auto",
        params: Sequence[str] | None = None,
        dtype: DtypeName | None = None,
        version: int | None = None,
        as_torch: bool = False,
        output: str | None = None,
    ) -> KernelResult:
        """Like ``ntk``, but returns a ``KernelResult``: theta plus implementation, version, elapsed_ms."""
        side1, side2 = _kernel_side(x1, "x1"), None if x2 is None else _kernel_side(x2, "x2")
        options: dict[str, Any] = {
            "mode": mode,
            "implementation": implementation,
            "params": list(params) if params is not None else None,
            "dtype": dtype,
            "version": version,
            **({} if output is None else {"output": output}),
        }
        path = f"/v1/models/{_segment(model)}/ntk"
        accept = _ACCEPT[self.transport_format]
        arrays = {"x1": side1} if side2 is None else {"x1": side1, "x2": side2}
        tensors = _side_tensors(arrays)
        if self.transport_format == "json" or tensors is None:
            # Data set slices only travel in JSON bodies; the response still follows transport_format.
            body = {"x1": _side_to_json(side1), "x2": _side_to_json(side2), **options}
            response = self._request("POST", path, json=body, accept=accept)
        else:
            if self.transport_format == "npy" and list(tensors) == ["x1"]:
                content, content_type = wire.encode_npy(tensors["x1"]), wire.MEDIA_NPY
            else:
                content, content_type = wire.encode_safetensors(tensors), wire.MEDIA_SAFETENSORS
            response = self._request(
                "POST", path, content=content, content_type=content_type, accept=accept, params=options
            )
        result = _kernel_result(response, model=model, as_torch=as_torch)
        if result.note:  # float64 inputs computed in float32: say so where the user sees it
            warnings.warn(f"ntk of {model!r}: {result.note}", UserWarning, stacklevel=2)
        return result


# ---- helpers ----


def _segment(value: str) -> str:
    """A path segment, percent-encoded so names with '/' or spaces cannot change the route."""
    return quote(str(value), safe="")


def _encode_weights(tensors: Mapping[str, Any], metadata: dict[str, str] | None) -> bytes:
    """A state_dict (torch or numpy values) as safetensors bytes."""
    arrays = {key: _to_numpy(value, name=key) for key, value in tensors.items()}
    return wire.encode_safetensors(arrays, metadata)


def _items(body: Any) -> list[dict[str, Any]]:
    """A list endpoint's items, whether the server wraps them (``{"data": [...], "count": n}``) or not."""
    if isinstance(body, dict) and "data" in body:
        body = body["data"]
    return [dict(item) for item in body]


def _to_numpy(value: Any, *, name: str) -> np.ndarray:
    """A numpy array from numpy, torch (any device, no grad) or nested lists, without importing torch."""
    if isinstance(value, np.ndarray):
        return value
    if is_torch_tensor(value):
        value = value.detach().cpu()
        try:
            return np.asarray(value.numpy())
        except TypeError as exc:  # e.g. bfloat16 has no numpy dtype
            raise TypeError(f"{name}: torch dtype {value.dtype} has no numpy equivalent; use .float()") from exc
    return np.asarray(value)


def _encode_npz(arrays: Mapping[Any, Any]) -> bytes:
    """Named arrays as an uncompressed .npz (names are checked by the server; a non-string name fails here)."""
    bad = [key for key in arrays if not isinstance(key, str)]
    if bad:
        raise TypeError(f"upload_dataset: array names must be strings, got {bad[:3]}")
    buffer = io.BytesIO()
    np.savez(buffer, allow_pickle=False, **{key: _to_numpy(value, name=key) for key, value in arrays.items()})
    return buffer.getvalue()


class NamedSide(dict[str, np.ndarray]):
    """A side of a model taking several inputs: name -> (N, ...) array (``x1.<name>`` in a safetensors body)."""


def _kernel_side(value: Any, name: str) -> np.ndarray | NamedSide | dict[str, Any]:
    """An array, named arrays (a mapping without ``dataset``), or a validated data set slice
    ``{"dataset": id, "start": i, "stop": j}``."""
    if isinstance(value, Mapping):
        if "dataset" not in value and not set(value) & {"start", "stop"}:  # start/stop: a slice missing its id
            if not value or not all(isinstance(key, str) for key in value):
                raise ValueError(f"{name}: named inputs need string keys, one array each; got keys {list(value)}")
            return NamedSide({key: _to_numpy(v, name=f"{name}[{key!r}]") for key, v in value.items()})
        unknown = set(value) - _DATASET_REF_KEYS
        if "dataset" not in value or unknown:
            raise ValueError(
                f"{name}: a data set slice is {{'dataset': id, 'start': i, 'stop': j}} "
                f"(start and stop optional); got keys {sorted(value)}"
            )
        return {key: value[key] for key in ("dataset", "start", "stop") if value.get(key) is not None}
    return _to_numpy(value, name=name)


def _side_tensors(sides: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
    """The tensors of a binary body (``x1``, or ``x1.<name>`` per named input); None when a side is a data set
    slice (those travel in JSON only)."""
    tensors: dict[str, np.ndarray] = {}
    for side, value in sides.items():
        if isinstance(value, NamedSide):
            tensors.update({f"{side}.{key}": array for key, array in value.items()})
        elif isinstance(value, np.ndarray):
            tensors[side] = value
        else:
            return None
    return tensors


def _side_to_json(side: np.ndarray | dict[str, Any] | None) -> dict[str, Any] | None:
    if isinstance(side, NamedSide):
        return {key: wire.tensor_to_json(array) for key, array in side.items()}
    return wire.tensor_to_json(side) if isinstance(side, np.ndarray) else side


def _kernel_result(response: httpx.Response, *, model: str, as_torch: bool) -> KernelResult:
    """Theta and its metadata from a JSON, safetensors or npy kernel response."""
    if _media(response) == wire.MEDIA_JSON:
        body = _decode_json(response)
        theta = wire.tensor_from_json(body.get("theta"), name="theta")
        meta = {
            key: body.get(key) for key in ("mode", "implementation", "model", "version", "elapsed_ms", "dtype", "note")
        }
    else:
        tensors, meta_strings = _decode_tensors(response, npy_name="theta")
        if "theta" not in tensors:
            raise NtkServiceError(f"kernel response: no tensor 'theta' in the body (got {sorted(tensors)})")
        theta = tensors["theta"]
        headers = {
            key[len(_NTK_HEADER_PREFIX) :].replace("-", "_"): value
            for key, value in response.headers.items()
            if key.lower().startswith(_NTK_HEADER_PREFIX)
        }
        meta = {**headers, **meta_strings}
    return KernelResult(
        theta=_maybe_torch(theta, as_torch),
        mode=cast(KernelModeName, str(meta.get("mode") or "")),
        implementation=cast(ImplementationName, str(meta.get("implementation") or "")),
        model=str(meta.get("model") or model),
        version=int(meta.get("version") or 0),
        elapsed_ms=float(meta.get("elapsed_ms") or 0.0),
        dtype=str(meta.get("dtype") or ""),
        note=str(meta["note"]) if meta.get("note") else None,
    )


def _maybe_torch(array: np.ndarray, as_torch: bool) -> Any:
    if not as_torch:
        return array
    import torch  # lazily: the client must import without torch installed

    return torch.from_numpy(array)
