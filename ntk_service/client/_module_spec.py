"""An ``nn.Sequential`` -> its ``sequential`` architecture spec, read from the modules' attributes, without torch.

    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> describe_module(model, input_shape=(4,))
    {'family': 'sequential', 'input_shape': [4], 'input_dtype': 'float32', 'layers': [{'type': 'Linear', ...}, ...]}

The client must import without torch, so modules are recognised by their exact class (module path and name, e.g.
``torch.nn.modules.conv.Conv2d``), never by ``isinstance``: a subclass may override ``forward``, so it is refused
like any other unknown module. Each reader gives the constructor keywords that rebuild the same layer; the server
validates them (``ntk_service/registry/layer_specs.py``) and checks the shapes on the declared input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ntk_service.errors import InvalidInput

__all__ = ["SUPPORTED_TYPES", "describe_module", "is_describable"]

Reader = Callable[[Any, str], dict[str, Any]]

_SEQUENTIAL = "torch.nn.modules.container.Sequential"


def _list(value: Any) -> Any:
    return list(value) if isinstance(value, tuple | list) else value


def _refuse(where: str, why: str) -> InvalidInput:
    return InvalidInput(f"register_module: the module at {where} {why}")


def _linear(m: Any, where: str) -> dict[str, Any]:
    return {"in_features": m.in_features, "out_features": m.out_features, "bias": m.bias is not None}


def _conv(m: Any, where: str) -> dict[str, Any]:
    return {
        "in_channels": m.in_channels,
        "out_channels": m.out_channels,
        "kernel_size": _list(m.kernel_size),
        "stride": _list(m.stride),
        "padding": _list(m.padding),
        "dilation": _list(m.dilation),
        "groups": m.groups,
        "bias": m.bias is not None,
        "padding_mode": m.padding_mode,
    }


def _ntk(read: Reader) -> Reader:
    def reader(m: Any, where: str) -> dict[str, Any]:
        return {**read(m, where), "parameterization": "ntk", "w_std": float(m.w_std), "b_std": float(m.b_std)}

    return reader


def _batch_norm(m: Any, where: str) -> dict[str, Any]:
    if not m.track_running_stats:
        raise _refuse(
            where,
            "is a BatchNorm with track_running_stats=False: it normalises each batch with its own statistics, so "
            "one example's kernel would depend on the others; build it with track_running_stats=True and train "
            "it so its running_mean and running_var are set",
        )
    return {
        "num_features": m.num_features,
        "eps": float(m.eps),
        "momentum": None if m.momentum is None else float(m.momentum),
        "affine": m.affine,
        "track_running_stats": True,
    }


def _layer_norm(m: Any, where: str) -> dict[str, Any]:
    return {
        "normalized_shape": _list(m.normalized_shape),
        "eps": float(m.eps),
        "elementwise_affine": m.elementwise_affine,
        "bias": m.bias is not None or not m.elementwise_affine,
    }


def _rms_norm(m: Any, where: str) -> dict[str, Any]:
    eps = None if m.eps is None else float(m.eps)
    return {"normalized_shape": _list(m.normalized_shape), "eps": eps, "elementwise_affine": m.elementwise_affine}


def _embedding(m: Any, where: str) -> dict[str, Any]:
    if m.max_norm is not None:
        raise _refuse(where, "is an Embedding with max_norm, which rescales its weight in place during the forward")
    return {"num_embeddings": m.num_embeddings, "embedding_dim": m.embedding_dim, "padding_idx": m.padding_idx}


def _max_pool(m: Any, where: str) -> dict[str, Any]:
    if m.return_indices:
        raise _refuse(where, "is a MaxPool2d with return_indices=True, whose output is not one tensor")
    return {
        "kernel_size": _list(m.kernel_size),
        "stride": _list(m.stride),
        "padding": _list(m.padding),
        "dilation": _list(m.dilation),
        "ceil_mode": m.ceil_mode,
    }


def _avg_pool(m: Any, where: str) -> dict[str, Any]:
    if m.divisor_override is not None:
        raise _refuse(where, "is an AvgPool2d with divisor_override, which the sequential architecture does not take")
    return {
        "kernel_size": _list(m.kernel_size),
        "stride": _list(m.stride),
        "padding": _list(m.padding),
        "ceil_mode": m.ceil_mode,
        "count_include_pad": m.count_include_pad,
    }


def _encoder_layer(m: Any, where: str) -> dict[str, Any]:
    activation = {1: "relu", 2: "gelu"}.get(m.activation_relu_or_gelu)
    if activation is None:
        raise _refuse(where, "is a TransformerEncoderLayer whose activation is neither 'relu' nor 'gelu'")
    if not m.self_attn.batch_first:
        raise _refuse(where, "is a TransformerEncoderLayer with batch_first=False; build it with batch_first=True")
    return {
        "d_model": m.self_attn.embed_dim,
        "nhead": m.self_attn.num_heads,
        "dim_feedforward": m.linear1.out_features,
        "dropout": float(m.dropout.p),
        "activation": activation,
        "layer_norm_eps": float(m.norm1.eps),
        "batch_first": True,
        "norm_first": bool(m.norm_first),
        "bias": m.linear1.bias is not None,
    }


def _no_keywords(m: Any, where: str) -> dict[str, Any]:
    return {}


def _residual(m: Any, where: str) -> dict[str, Any]:
    shortcut = None if m.shortcut is None else _layers(m.shortcut, f"{where}.shortcut")
    return {"body": _layers(m.body, f"{where}.body"), "shortcut": shortcut}


def _sequential(m: Any, where: str) -> dict[str, Any]:
    return {"layers": _layers(m, where)}


def _attrs(*names: str) -> Reader:
    def reader(m: Any, where: str) -> dict[str, Any]:
        return {name: _list(getattr(m, name)) for name in names}

    return reader


_READERS: dict[str, tuple[str, Reader]] = {
    "torch.nn.modules.linear.Linear": ("Linear", _linear),
    "torch.nn.modules.linear.Identity": ("Identity", _no_keywords),
    "torch.nn.modules.conv.Conv1d": ("Conv1d", _conv),
    "torch.nn.modules.conv.Conv2d": ("Conv2d", _conv),
    "torch.nn.modules.batchnorm.BatchNorm1d": ("BatchNorm1d", _batch_norm),
    "torch.nn.modules.batchnorm.BatchNorm2d": ("BatchNorm2d", _batch_norm),
    "torch.nn.modules.normalization.LayerNorm": ("LayerNorm", _layer_norm),
    "torch.nn.modules.normalization.GroupNorm": ("GroupNorm", _attrs("num_groups", "num_channels", "eps", "affine")),
    "torch.nn.modules.normalization.RMSNorm": ("RMSNorm", _rms_norm),
    "torch.nn.modules.sparse.Embedding": ("Embedding", _embedding),
    "torch.nn.modules.dropout.Dropout": ("Dropout", _attrs("p")),
    "torch.nn.modules.flatten.Flatten": ("Flatten", _attrs("start_dim", "end_dim")),
    "torch.nn.modules.pooling.MaxPool2d": ("MaxPool2d", _max_pool),
    "torch.nn.modules.pooling.AvgPool2d": ("AvgPool2d", _avg_pool),
    "torch.nn.modules.pooling.AdaptiveAvgPool2d": ("AdaptiveAvgPool2d", _attrs("output_size")),
    "torch.nn.modules.activation.ReLU": ("ReLU", _no_keywords),
    "torch.nn.modules.activation.Tanh": ("Tanh", _no_keywords),
    "torch.nn.modules.activation.Sigmoid": ("Sigmoid", _no_keywords),
    "torch.nn.modules.activation.SiLU": ("SiLU", _no_keywords),
    "torch.nn.modules.activation.GELU": ("GELU", _attrs("approximate")),
    "torch.nn.modules.activation.LeakyReLU": ("LeakyReLU", _attrs("negative_slope")),
    "torch.nn.modules.activation.ELU": ("ELU", _attrs("alpha")),
    "torch.nn.modules.activation.Softplus": ("Softplus", _attrs("beta", "threshold")),
    "torch.nn.modules.transformer.TransformerEncoderLayer": ("TransformerEncoderLayer", _encoder_layer),
    "ntk_service.layers.NtkLinear": ("Linear", _ntk(_linear)),
    "ntk_service.layers.NtkConv1d": ("Conv1d", _ntk(_conv)),
    "ntk_service.layers.NtkConv2d": ("Conv2d", _ntk(_conv)),
    "ntk_service.layers.Residual": ("Residual", _residual),
    _SEQUENTIAL: ("Sequential", _sequential),
    "ntk_service.layers.MeanPool": ("MeanPool", _attrs("dim")),
    "ntk_service.layers.PositionEmbedding": (
        "PositionEmbedding",
        lambda m, where: {"num_positions": m.embedding.num_embeddings, "embedding_dim": m.embedding.embedding_dim},
    ),
}
"""Exact class -> (layer type, reader of its constructor keywords)."""

SUPPORTED_TYPES = tuple(sorted({kind for kind, _ in _READERS.values()}))
"""The layer types ``describe_module`` produces (the server's allow-list: tests compare the two)."""


def _class_path(module: Any) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _layers(sequential: Any, path: str) -> list[dict[str, Any]]:
    layers = []
    for i, (key, child) in enumerate(sequential.named_children()):
        where = f"{path}.{key}" if path else str(key)
        if key != str(i):  # nn.Sequential(OrderedDict(...)): a spec is a list, so its layers are named 0, 1, ...
            raise _refuse(
                where,
                f"is named {key!r}, not {str(i)!r}: the 'sequential' architecture names layers by their position, "
                "so its weights would not upload under your names; build the nn.Sequential from a list of layers",
            )
        layers.append(_layer(child, where))
    return layers


def _layer(module: Any, where: str) -> dict[str, Any]:
    path = _class_path(module)
    entry = _READERS.get(path)
    if entry is None:
        hint = (
            f"; supported: torch.nn {', '.join(SUPPORTED_TYPES)} (ntk_service.layers for Residual, MeanPool, "
            "PositionEmbedding and the Ntk* layers). Rebuild it from those, or ask the server's operator for a "
            "factory that builds it (family 'factory'; GET /v1/architectures lists those allowed)"
        )
        raise _refuse(where, f"is a {path}, which the 'sequential' architecture does not support{hint}")
    if "forward" in vars(module):
        raise _refuse(where, "has its own forward set on the instance, so it is not the stock layer")
    kind, read = entry
    return {"type": kind, **read(module, where)}


def is_describable(module: Any) -> bool:
    """Whether ``module`` is an ``nn.Sequential`` that ``describe_module`` can read: at every depth only the exact
    classes it knows, children named by position, no forward set on an instance. Anything else is exported."""
    return _class_path(module) == _SEQUENTIAL and _describable(module)


def _describable(module: Any) -> bool:
    path = _class_path(module)
    if path not in _READERS or "forward" in vars(module):
        return False
    if path == _SEQUENTIAL:
        return _describable_children(module)
    if path == "ntk_service.layers.Residual":
        return _describable_children(module.body) and (
            module.shortcut is None or _describable_children(module.shortcut)
        )
    return True


def _describable_children(container: Any) -> bool:
    children = list(container.named_children())
    return all(key == str(i) and _describable(child) for i, (key, child) in enumerate(children))


def describe_module(module: Any, *, input_shape: Sequence[int], input_dtype: str = "float32") -> dict[str, Any]:
    """The ``sequential`` architecture spec that rebuilds ``module`` with the same parameter and buffer names.

    Args:
        module (nn.Sequential): the model, made of supported layers (``SUPPORTED_TYPES``), nesting through
            ``ntk_service.layers.Residual`` and ``nn.Sequential`` (at most 4 deep); names are kept (``3.0.weight``).
        input_shape (Sequence[int]): one example's shape, without the batch dimension.
        input_dtype (str): "float32", or "int64" for token ids. Default: "float32".

    Returns:
        ``{"family": "sequential", "input_shape": [...], "input_dtype": ..., "layers": [...]}``.

    Raises:
        InvalidInput: ``module`` is not an ``nn.Sequential``, or names the first module (by its path, e.g. ``3.body.1``)
            that is not supported, and says what to do instead.
    """
    if _class_path(module) != _SEQUENTIAL:
        raise InvalidInput(
            f"register_module: expected a torch.nn.Sequential, got {_class_path(module)}; wrap the layers in "
            "nn.Sequential (or register the model through an operator factory, family 'factory')"
        )
    return {
        "family": "sequential",
        "input_shape": [int(n) for n in input_shape],
        "input_dtype": input_dtype,
        "layers": _layers(module, ""),
    }
