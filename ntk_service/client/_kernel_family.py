"""The kernel family from Python: the NNGP / conjugate kernel, Monte Carlo kernels and Θ·v products.

    >>> k = client.nngp("mlp", x1, layer="activation", mode="trace")          # doctest: +SKIP
    >>> mc = client.monte_carlo("mlp", x1, seeds=range(16), mode="trace")     # doctest: +SKIP
    >>> mc.mean.shape, mc.stderr.shape                                        # (N, N) each
    >>> y = client.matvec("mlp", x1, v=np.ones((len(x1), 3)))                 # doctest: +SKIP
    ... # (N, k) = Θ(x1, x1) v

The pseudo-NTK is ``client.ntk(model, x1, mode="pseudo")``. JSON bodies (inputs inline or data set slices); the
answers come as safetensors unless ``transport_format="json"``.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import quote

import httpx
import numpy as np

from ntk_service import wire
from ntk_service._tensors import is_torch_tensor
from ntk_service.client._base import BaseClient, _decode_json, _decode_tensors, _media, _named_side_json
from ntk_service.client._types import DtypeName, FamilyKernelName, KernelModeName, OperatorModeName

__all__ = ["KernelFamilyClient", "MonteCarloKernel", "NngpKernel"]


@dataclass(frozen=True)
class NngpKernel:
    """``client.nngp_result``'s answer.

    Attributes:
        kernel: the mode's shape (``vocabulary.MODES``) with d for k, e.g. (N, M, d, d) "full", (N, M) "trace";
            d = k for the outputs, the layer's flattened size for a layer.
        mode, layer, features (d), model, version, elapsed_ms: how it was computed.
    """

    kernel: Any
    mode: KernelModeName
    layer: str | None
    features: int
    model: str
    version: int
    elapsed_ms: float


@dataclass(frozen=True)
class MonteCarloKernel:
    """``client.monte_carlo``'s answer.

    Attributes:
        mean: the kernel averaged over the seeds (shaped as the mode's kernel).
        stderr: its per-entry standard error, same shape; None for one seed.
        n_samples: how many seeds (networks) were averaged.
        kernel: "ntk" or "nngp".
        mode: the kernel mode's wire value.
        models_per_chunk: networks evaluated as one batched call.
        model: the model's name.
        elapsed_ms: server-side compute time in milliseconds.
    """

    mean: Any
    stderr: Any
    n_samples: int
    kernel: FamilyKernelName
    mode: KernelModeName
    models_per_chunk: int
    model: str
    elapsed_ms: float


def _side(value: Any, name: str) -> dict[str, Any] | None:
    """A JSON side: a data set slice as given (the server validates it), named tensors (a mapping without
    ``dataset``, for a model taking several inputs), anything array-like as a tensor."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return dict(value) if "dataset" in value else _named_side_json(value, name)
    if is_torch_tensor(value):
        value = value.detach().cpu().numpy()
    return wire.tensor_to_json(np.asarray(value))


def _seed(value: Any) -> Any:
    """A seed for JSON: numpy integers as ints; anything else as given, for the server to refuse by name (``int()``
    would turn 1.5 into 1, "7" into 7 and True into 1 silently)."""
    if isinstance(value, bool | np.bool_):
        return bool(value)
    try:
        return operator.index(value)
    except TypeError:
        return value.item() if isinstance(value, np.generic) else value


def _maybe_torch(array: np.ndarray | None, as_torch: bool) -> Any:
    if array is None or not as_torch:
        return array
    import torch  # lazily: the client must import without torch installed

    return torch.from_numpy(array)


class KernelFamilyClient(BaseClient):
    """The kernel-family methods of ``Client`` (see the module docstring)."""

    def _family_post(
        self, model: str, route: str, body: dict[str, Any], names: tuple[str, ...]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """POST a JSON body; returns (the tensors ``names`` (None when absent or null), the metadata)."""
        accept = wire.MEDIA_JSON if self.transport_format == "json" else wire.MEDIA_SAFETENSORS
        path = f"/v1/models/{quote(model, safe='')}/{route}"
        response: httpx.Response = self._request("POST", path, json=body, accept=accept)
        if _media(response) == wire.MEDIA_JSON:
            data = _decode_json(response)
            raw = {name: data.pop(name, None) for name in names}
            return {k: None if v is None else wire.tensor_from_json(v, name=k) for k, v in raw.items()}, data
        arrays, meta = _decode_tensors(response, npy_name=names[0])
        return {name: arrays.get(name) for name in names}, {key: value for key, value in meta.items()}

    def nngp_result(
        self,
        model: str,
        x1: Any,
        x2: Any = None,
        *,
        layer: str | None = None,
        mode: KernelModeName = "full",
        dtype: DtypeName | None = None,
        version: int | None = None,
        as_torch: bool = False,
        output: str | None = None,
    ) -> NngpKernel:
        """The empirical NNGP f(x1) f(x2)ᵀ of a registered model, or the conjugate kernel at ``layer``.

        Args:
            model (str): the model's name.
            x1, x2: (N, *input), (M, *input) arrays or data set slices; x2 None means x2 = x1. Default: None.
            layer (str | None): a module name (e.g. "activation"): its output's features. Default: the outputs.
            mode (str): a mode of ``vocabulary.MODE_NAMES`` (docs/concepts.md, "Modes"). Default: "full".
            dtype (str | None): "float32" or "float64". Default: the model's.
            version (int | None): the model version. Default: the latest.
            as_torch (bool): torch tensors instead of numpy arrays. Default: False.
            output (str | None): for a model returning a dict, the tensor f is, as for ``ntk``. Default: None.

        Raises:
            ModelNotFound, UnknownLayer, InvalidInput, MemoryEstimateExceeded, Busy.
        """
        body = {"x1": _side(x1, "x1"), "x2": _side(x2, "x2"), "layer": layer, "mode": mode, "dtype": dtype}
        if output is not None:
            body["output"] = output
        tensors, meta = self._family_post(model, "nngp", {**body, "version": version}, ("kernel",))
        layer_meta = meta.get("layer")
        return NngpKernel(
            kernel=_maybe_torch(tensors["kernel"], as_torch),
            mode=cast(KernelModeName, str(meta["mode"])),
            layer=None if layer_meta in (None, "None") else str(layer_meta),
            features=int(meta["features"]),
            model=str(meta["model"]),
            version=int(meta["version"]),
            elapsed_ms=float(meta["elapsed_ms"]),
        )

    def nngp(self, model: str, x1: Any, x2: Any = None, **options: Any) -> Any:
        """``nngp_result(...).kernel``: the kernel array alone (same arguments)."""
        return self.nngp_result(model, x1, x2, **options).kernel

    def monte_carlo(
        self,
        model: str,
        x1: Any,
        x2: Any = None,
        *,
        seeds: Sequence[int],
        kernel: FamilyKernelName = "ntk",
        mode: KernelModeName = "full",
        layer: str | None = None,
        params: Sequence[str] | None = None,
        dtype: DtypeName | None = None,
        as_torch: bool = False,
    ) -> MonteCarloKernel:
        """The NTK (or NNGP) of the model's architecture averaged over one fresh network per seed.

        Args:
            model (str): a registered model; its architecture is built once per seed (its weights are not used).
            x1, x2: as ``nngp_result``.
            seeds (Sequence[int]): 1 to 1024 distinct seeds.
            kernel (str): "ntk" or "nngp". Default: "ntk".
            mode (str): any kernel mode, "pseudo" included. Default: "full".
            layer (str | None): kernel="nngp" only: the module whose features to use. Default: None.
            params (Sequence[str] | None): kernel="ntk" only: parameter globs. Default: all.
            dtype (str | None): "float32" or "float64". Default: the model's.
            as_torch (bool): torch tensors instead of numpy arrays. Default: False.

        Returns:
            MonteCarloKernel: ``mean`` and ``stderr`` (None for one seed), shaped as the mode's kernel.
        """
        body = {
            "x1": _side(x1, "x1"),
            "x2": _side(x2, "x2"),
            "seeds": [_seed(s) for s in seeds],
            "kernel": kernel,
            "mode": mode,
            "layer": layer,
            "params": None if params is None else list(params),
            "dtype": dtype,
        }
        tensors, meta = self._family_post(model, "monte_carlo", body, ("mean", "stderr"))
        return MonteCarloKernel(
            mean=_maybe_torch(tensors["mean"], as_torch),
            stderr=_maybe_torch(tensors.get("stderr"), as_torch),
            n_samples=int(meta["n_samples"]),
            kernel=cast(FamilyKernelName, str(meta["kernel"])),
            mode=cast(KernelModeName, str(meta["mode"])),
            models_per_chunk=int(meta["models_per_chunk"]),
            model=str(meta["model"]),
            elapsed_ms=float(meta["elapsed_ms"]),
        )

    def matvec(
        self,
        model: str,
        x1: Any,
        x2: Any = None,
        *,
        v: Any,
        mode: OperatorModeName = "full",
        transpose: bool = False,
        params: Sequence[str] | None = None,
        dtype: DtypeName | None = None,
        version: int | None = None,
        as_torch: bool = False,
        output: str | None = None,
    ) -> Any:
        """One product Θ(x1, x2) v (or Θᵀ v with ``transpose``), computed without building Θ.

        Args:
            model, x1, x2: as ``nngp_result``.
            v: (M, k) for "full", (M,) for "trace" and "pseudo"; (N, k) / (N,) with ``transpose``.
            mode (str): "full" | "trace" | "pseudo". Default: "full".
            transpose (bool): Θ(x2, x1) v instead. Default: False.
            params, dtype, version, as_torch, output: as for ``ntk``.

        Returns:
            (N, k) for "full", (N,) otherwise ((M, ...) with ``transpose``).
        """
        body: dict[str, Any] = {
            "x1": _side(x1, "x1"),
            "x2": _side(x2, "x2"),
            "v": _side(v, "v"),
            "mode": mode,
            "transpose": transpose,
            "params": None if params is None else list(params),
            "dtype": dtype,
            "version": version,
        }
        if output is not None:
            body["output"] = output
        tensors, _ = self._family_post(model, "operator/matvec", body, ("product",))
        return _maybe_torch(tensors["product"], as_torch)
