"""Per-layer kernels from Python: Θ_g for every parameter group of a registered model, in one request.

    >>> res = client.ntk_groups("mlp", x1, groups="modules", mode="trace")        # doctest: +SKIP
    >>> {name: theta.shape for name, theta in res.thetas.items()}                 # one (N, N) per layer
    >>> res = client.ntk_groups("cnn", x1, groups={"conv": ["features.*"]}, rest=True)  # doctest: +SKIP

The answer is a safetensors body with one tensor per group (JSON with ``transport_format="json"``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import numpy as np

from ntk_service import wire
from ntk_service._tensors import is_torch_tensor
from ntk_service.client._base import BaseClient, _decode_json, _decode_tensors, _media
from ntk_service.errors import NtkServiceError

__all__ = ["GroupKernels", "GroupsClient"]


@dataclass(frozen=True)
class GroupKernels:
    """``client.ntk_groups``'s answer.

    Attributes:
        thetas: group name -> Θ_g, in the order of the request (``"modules"``: the model's module order), each
            shaped as the mode's kernel (``vocabulary.MODES``, e.g. (N, M, k, k) "full", (N, M) "trace"); numpy,
            or torch with ``as_torch=True``.
        parameters: group name -> the parameter names in it.
        mode, implementation, model, version, elapsed_ms: how it was computed.
    """

    thetas: dict[str, Any]
    parameters: dict[str, list[str]]
    mode: str
    implementation: str
    model: str
    version: int
    elapsed_ms: float

    def total(self) -> Any:
        """Σ_g Θ_g: the kernel of every grouped parameter."""
        return sum(self.thetas.values())


def _side(value: Any, name: str) -> dict[str, Any] | np.ndarray:
    """A data set slice as given (the server validates it), anything array-like as an array."""
    if isinstance(value, Mapping):
        return dict(value)
    if is_torch_tensor(value):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _groups_value(groups: str | Mapping[str, Sequence[str]]) -> str | dict[str, Any]:
    """``groups`` for JSON: a glob list per group (a bare string is sent as is, for the server to refuse by name)."""
    if isinstance(groups, str):
        return groups
    return {str(name): p if isinstance(p, str) else list(p) for name, p in groups.items()}


class GroupsClient(BaseClient):
    """The per-layer kernel method of ``Client`` (see the module docstring)."""

    def ntk_groups(
        self,
        model: str,
        x1: Any,
        x2: Any = None,
        *,
        groups: str | Mapping[str, Sequence[str]] = "modules",
        rest: bool = False,
        mode: str = "full",
        implementation: str = "auto",
        dtype: str | None = None,
        version: int | None = None,
        as_torch: bool = False,
    ) -> GroupKernels:
        """The NTK of a registered model split by parameter group: Θ_g = J_g(x1) J_g(x2)ᵀ for each group.

        Args:
            model (str): the model's name.
            x1, x2: as for ``ntk`` (arrays, tensors or data set slices); x2 None means x2 = x1.
            groups (str | Mapping[str, Sequence[str]]): ``"modules"`` (one group per module with parameters of its
                own) or ``{"name": ["glob", ...]}`` over parameter names. Default: "modules".
            rest (bool): collect the parameters no group lists as a group "rest". Default: False (left out).
            mode, implementation, dtype, version, as_torch: as for ``ntk`` ("ntk_vector_products" is refused:
                it has no per-parameter terms).

        Returns:
            GroupKernels: ``thetas`` (group -> kernel) and ``parameters`` (group -> names).

        Raises:
            InvalidInput: overlapping groups (OverlappingGroups), a glob that matches nothing
                (NoMatchingParameters), bad inputs (422).
            MemoryEstimateExceeded: the G kernels would not fit the server's memory budget (413).
            ModelNotFound, DatasetNotFound, Busy: as for ``ntk``.
        """
        side1, side2 = _side(x1, "x1"), None if x2 is None else _side(x2, "x2")
        options: dict[str, Any] = {
            "mode": mode,
            "implementation": implementation,
            "dtype": dtype,
            "version": version,
            "rest": rest,
        }
        path = f"/v1/models/{quote(model, safe='')}/ntk"
        accept = wire.MEDIA_JSON if self.transport_format == "json" else wire.MEDIA_SAFETENSORS
        sides = {"x1": side1} if side2 is None else {"x1": side1, "x2": side2}
        arrays = {key: value for key, value in sides.items() if isinstance(value, np.ndarray)}
        if self.transport_format == "json" or len(arrays) < len(sides):
            body: dict[str, Any] = {
                key: wire.tensor_to_json(value) if isinstance(value, np.ndarray) else value
                for key, value in sides.items()
            }
            body.update(options)
            body["groups"] = _groups_value(groups)
            response = self._request("POST", path, json=body, accept=accept)
        else:  # a safetensors body: the options in the query, groups as "modules" or a JSON object
            query = {key: value for key, value in options.items() if value is not None}
            query["rest"] = "true" if rest else "false"
            query["groups"] = groups if isinstance(groups, str) else json.dumps(_groups_value(groups))
            content = wire.encode_safetensors(arrays)
            response = self._request(
                "POST", path, content=content, content_type=wire.MEDIA_SAFETENSORS, accept=accept, params=query
            )
        return _group_kernels(response, model=model, as_torch=as_torch)


def _group_kernels(response: Any, *, model: str, as_torch: bool) -> GroupKernels:
    """The group kernels and metadata from a JSON or safetensors answer."""
    if _media(response) == wire.MEDIA_JSON:
        body = _decode_json(response)
        entries = body.get("groups") or []
        thetas: dict[str, Any] = {
            str(e["name"]): wire.tensor_from_json(e["theta"], name=str(e["name"])) for e in entries
        }
        parameters = {str(e["name"]): [str(p) for p in e.get("parameters", [])] for e in entries}
        meta: Mapping[str, Any] = body
    else:
        tensors, meta = _decode_tensors(response, npy_name="theta")
        try:
            names = [str(n) for n in json.loads(meta.get("groups", "[]"))]
            listed = json.loads(meta.get("parameters", "{}"))
        except ValueError as exc:
            raise NtkServiceError(f"group kernel response: unreadable metadata ({exc})") from exc
        missing = [name for name in names if name not in tensors]
        if missing:
            raise NtkServiceError(f"group kernel response: no tensor for group(s) {missing} (got {sorted(tensors)})")
        thetas = {name: tensors[name] for name in names}
        parameters = {name: [str(p) for p in listed.get(name, [])] for name in names}
    if as_torch:
        import torch  # lazily: the client must import without torch installed

        thetas = {name: torch.from_numpy(theta) for name, theta in thetas.items()}
    return GroupKernels(
        thetas=thetas,
        parameters=parameters,
        mode=str(meta.get("mode") or ""),
        implementation=str(meta.get("implementation") or ""),
        model=str(meta.get("model") or model),
        version=int(meta.get("version") or 0),
        elapsed_ms=float(meta.get("elapsed_ms") or 0.0),
    )
