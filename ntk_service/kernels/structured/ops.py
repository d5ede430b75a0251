"""The operators the structured engine reads a model by: every callable a torch function mode may see for one
operation, eager (``F.linear``, ``Tensor.mul``) and ATen (``torch.ops.aten.linear.default``, what an exported
program's graph calls), with its argument names, so one rule serves ``nn.Module`` forwards and programs alike.

    >>> form = OPS[torch.ops.aten.linear.default]        # Op("linear", ("input", "weight", "bias"))
    >>> form.bind((x, w), {})                            # {"input": x, "weight": w}

An op's ``family`` names what it computes ("linear", "conv", "add", ...); its ``names`` are the callable's
arguments in order (a method's ``self`` first; for ``__radd__``-style methods ``self`` is the right operand, which
``swapped`` records). ``torch.Tensor`` methods and their dunder forms reach a ``TorchFunctionMode`` as the method
objects listed here (``x * y`` arrives as ``Tensor.mul`` or ``Tensor.__mul__``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["METADATA", "OPS", "Op", "op_name"]

aten = torch.ops.aten
_T = torch.Tensor


@dataclass(frozen=True)
class Op:
    """One callable's view of an operation.

    Attributes:
        family: the operation ("linear", "matmul", "addmm", "conv", "convolution", "embedding", "aten_embedding",
            "layer_norm", "rms_norm", "group_norm", "batch_norm", "aten_batch_norm", "add", "sub", "rsub", "mul",
            "div", "neg", "expand", "expand_as", or a derivation: "t", "transpose", "permute", "view", "reshape",
            "unsqueeze", "squeeze", "flatten", "identity", "getitem", "slice", "select", "narrow", "split",
            "chunk").
        names: the argument names in call order.
        swapped: the callable is a reflected dunder (``__radd__``): its first argument is the right operand.
    """

    family: str
    names: tuple[str, ...]
    swapped: bool = False
    varargs: bool = False

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Arguments by name (positional ones by ``names``, then the keywords); a reflected dunder's two operands
        are bound as (other, self); a varargs method's trailing arguments as one tuple (``x.view(2, 3)``)."""
        bound = dict(zip(self.names, args, strict=False))
        if self.swapped and len(args) >= 2:
            bound[self.names[0]], bound[self.names[1]] = args[1], args[0]
        if self.varargs and len(args) > len(self.names) - 1 and not isinstance(args[-1], list | tuple):
            bound[self.names[-1]] = tuple(args[len(self.names) - 1 :])
        bound.update(kwargs)
        return bound


def _op(family: str, *names: str, swapped: bool = False, varargs: bool = False) -> Op:
    return Op(family, names, swapped, varargs)


_BINARY = ("input", "other")

OPS: dict[Any, Op] = {
    # the linear family: y = a Wᵀ + b, y = a M, y = β b + α a M
    F.linear: _op("linear", "input", "weight", "bias"),
    aten.linear.default: _op("linear", "input", "weight", "bias"),
    torch.matmul: _op("matmul", *_BINARY),
    _T.matmul: _op("matmul", *_BINARY),
    _T.__matmul__: _op("matmul", *_BINARY),
    aten.matmul.default: _op("matmul", "input", "other"),
    torch.mm: _op("matmul", "input", "other"),
    _T.mm: _op("matmul", "input", "other"),
    aten.mm.default: _op("matmul", "input", "other"),
    torch.addmm: _op("addmm", "input", "mat1", "mat2", "beta", "alpha"),
    _T.addmm: _op("addmm", "input", "mat1", "mat2", "beta", "alpha"),
    aten.addmm.default: _op("addmm", "input", "mat1", "mat2"),
    # convolutions (1-D and 2-D)
    F.conv1d: _op("conv", "input", "weight", "bias", "stride", "padding", "dilation", "groups"),
    F.conv2d: _op("conv", "input", "weight", "bias", "stride", "padding", "dilation", "groups"),
    aten.conv1d.default: _op("conv", "input", "weight", "bias", "stride", "padding", "dilation", "groups"),
    aten.conv2d.default: _op("conv", "input", "weight", "bias", "stride", "padding", "dilation", "groups"),
    aten.conv1d.padding: _op("conv", "input", "weight", "bias", "stride", "padding", "dilation", "groups"),
    aten.conv2d.padding: _op("conv", "input", "weight", "bias", "stride", "padding", "dilation", "groups"),
    aten.convolution.default: _op(
        "convolution",
        "input",
        "weight",
        "bias",
        "stride",
        "padding",
        "dilation",
        "transposed",
        "output_padding",
        "groups",
    ),  # fmt: skip
    # embedding lookups
    F.embedding: _op(
        "embedding", "input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"
    ),
    aten.embedding.default: _op("aten_embedding", "weight", "input", "padding_idx", "scale_grad_by_freq", "sparse"),
    # normalisations (their affine parameters)
    F.layer_norm: _op("layer_norm", "input", "normalized_shape", "weight", "bias", "eps"),
    aten.layer_norm.default: _op("layer_norm", "input", "normalized_shape", "weight", "bias", "eps", "cudnn_enable"),
    F.rms_norm: _op("rms_norm", "input", "normalized_shape", "weight", "eps"),
    aten.rms_norm.default: _op("rms_norm", "input", "normalized_shape", "weight", "eps"),
    F.group_norm: _op("group_norm", "input", "num_groups", "weight", "bias", "eps"),
    aten.group_norm.default: _op("group_norm", "input", "num_groups", "weight", "bias", "eps", "cudnn_enabled"),
    F.batch_norm: _op(
        "batch_norm", "input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"
    ),
    aten.batch_norm.default: _op(
        "batch_norm",
        "input",
        "weight",
        "bias",
        "running_mean",
        "running_var",
        "training",
        "momentum",
        "eps",
        "cudnn_enabled",
    ),  # fmt: skip
    # elementwise (a parameter as a scale, a bias, or broadcast over the examples); by numbers: derivations
    torch.add: _op("add", "input", "other", "alpha"),
    _T.add: _op("add", "input", "other", "alpha"),
    _T.__add__: _op("add", *_BINARY),
    _T.__radd__: _op("add", *_BINARY, swapped=True),
    aten.add.Tensor: _op("add", "input", "other"),
    torch.sub: _op("sub", "input", "other", "alpha"),
    _T.sub: _op("sub", "input", "other", "alpha"),
    _T.__sub__: _op("sub", *_BINARY),
    _T.__rsub__: _op("sub", *_BINARY, swapped=True),
    aten.sub.Tensor: _op("sub", "input", "other"),
    torch.rsub: _op("rsub", "input", "other", "alpha"),
    aten.rsub.Tensor: _op("rsub", "input", "other"),
    aten.rsub.Scalar: _op("rsub", "input", "other"),
    torch.mul: _op("mul", *_BINARY),
    _T.mul: _op("mul", *_BINARY),
    _T.__mul__: _op("mul", *_BINARY),
    _T.__rmul__: _op("mul", *_BINARY, swapped=True),
    aten.mul.Tensor: _op("mul", *_BINARY),
    aten.mul.Scalar: _op("mul", *_BINARY),
    torch.div: _op("div", "input", "other", "rounding_mode"),
    _T.div: _op("div", "input", "other", "rounding_mode"),
    _T.__truediv__: _op("div", *_BINARY),
    aten.div.Tensor: _op("div", *_BINARY),
    aten.div.Scalar: _op("div", *_BINARY),
    torch.neg: _op("neg", "input"),
    _T.neg: _op("neg", "input"),
    _T.__neg__: _op("neg", "input"),
    aten.neg.default: _op("neg", "input"),
    _T.expand: _op("expand", "input", "size", varargs=True),
    aten.expand.default: _op("expand", "input", "size"),
    _T.expand_as: _op("expand_as", "input", "other"),
    # derivations: a view or copy of a parameter's elements (the index map follows them)
    torch.t: _op("t", "input"),
    _T.t: _op("t", "input"),
    _T.T.__get__: _op("t", "input"),  # type: ignore[attr-defined]  # the .T property's getter
    aten.t.default: _op("t", "input"),
    aten.numpy_T.default: _op("t", "input"),
    torch.transpose: _op("transpose", "input", "dim0", "dim1"),
    _T.transpose: _op("transpose", "input", "dim0", "dim1"),
    aten.transpose.int: _op("transpose", "input", "dim0", "dim1"),
    torch.permute: _op("permute", "input", "dims"),
    _T.permute: _op("permute", "input", "dims", varargs=True),
    aten.permute.default: _op("permute", "input", "dims"),
    _T.view: _op("view", "input", "size", varargs=True),
    aten.view.default: _op("view", "input", "size"),
    torch.reshape: _op("reshape", "input", "shape"),
    _T.reshape: _op("reshape", "input", "shape", varargs=True),
    aten.reshape.default: _op("reshape", "input", "shape"),
    aten._unsafe_view.default: _op("reshape", "input", "shape"),
    torch.unsqueeze: _op("unsqueeze", "input", "dim"),
    _T.unsqueeze: _op("unsqueeze", "input", "dim"),
    aten.unsqueeze.default: _op("unsqueeze", "input", "dim"),
    torch.squeeze: _op("squeeze", "input", "dim"),
    _T.squeeze: _op("squeeze", "input", "dim"),
    aten.squeeze.dim: _op("squeeze", "input", "dim"),
    aten.squeeze.default: _op("squeeze", "input"),
    torch.flatten: _op("flatten", "input", "start_dim", "end_dim"),
    _T.flatten: _op("flatten", "input", "start_dim", "end_dim"),
    aten.flatten.using_ints: _op("flatten", "input", "start_dim", "end_dim"),
    _T.contiguous: _op("identity", "input"),
    aten.contiguous.default: _op("identity", "input"),
    torch.clone: _op("identity", "input"),
    _T.clone: _op("identity", "input"),
    aten.clone.default: _op("identity", "input"),
    aten.alias.default: _op("identity", "input"),
    _T.__getitem__: _op("getitem", "input", "key"),
    aten.slice.Tensor: _op("slice", "input", "dim", "start", "end", "step"),
    torch.select: _op("select", "input", "dim", "index"),
    _T.select: _op("select", "input", "dim", "index"),
    aten.select.int: _op("select", "input", "dim", "index"),
    torch.narrow: _op("narrow", "input", "dim", "start", "length"),
    _T.narrow: _op("narrow", "input", "dim", "start", "length"),
    aten.narrow.default: _op("narrow", "input", "dim", "start", "length"),
    torch.split: _op("split", "input", "split_size_or_sections", "dim"),
    _T.split: _op("split", "input", "split_size", "dim"),
    aten.split.Tensor: _op("split", "input", "split_size", "dim"),
    aten.split_with_sizes.default: _op("split", "input", "split_sizes", "dim"),
    torch.chunk: _op("chunk", "input", "chunks", "dim"),
    _T.chunk: _op("chunk", "input", "chunks", "dim"),
    aten.chunk.default: _op("chunk", "input", "chunks", "dim"),
}
"""Every callable the structured engine reads, by the object a ``TorchFunctionMode`` receives."""

_METADATA_METHODS = frozenset(
    {"size", "dim", "numel", "__len__", "stride", "element_size", "is_floating_point", "is_complex", "is_contiguous"}
    | {"sym_size", "sym_numel", "sym_stride"}
)
_METADATA_PROPERTIES = frozenset({"shape", "ndim", "dtype", "device", "layout", "requires_grad", "is_leaf"})


def METADATA(func: object) -> bool:  # noqa: N802 - read as a table: METADATA(func)
    """Whether ``func`` reads a tensor's metadata only (``w.shape[0]`` to size something): not a use of its values."""
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property getter: its descriptor is func.__self__
        return getattr(getattr(func, "__self__", None), "__name__", "") in _METADATA_PROPERTIES
    if isinstance(func, torch._ops.OpOverload):
        return func.__name__.split(".")[0] in _METADATA_METHODS
    return name in _METADATA_METHODS


def op_name(func: object) -> str:
    """A short name of a callable for reports: ``linear``, ``aten.div.Tensor``, ``Tensor.pow``."""
    if isinstance(func, torch._ops.OpOverload):
        name = func.__name__.removesuffix(".default")
        return f"aten.{name}" if func.namespace == "aten" else str(func)
    owner = getattr(func, "__objclass__", None) or getattr(getattr(func, "__self__", None), "__objclass__", None)
    name = getattr(func, "__name__", None) or type(func).__name__
    if owner is not None and owner.__name__ in ("TensorBase", "Tensor"):
        return f"Tensor.{name}"
    return str(name)
