"""What the scoped rewrites of torch functions share (``affine_batchnorm``, ``pointwise_convolution``): a
``TorchFunctionMode`` that binds a rewritten call's arguments by name and hands them to one hook, and how a scope
sees an exported program, whose layers are ATen calls rather than ``nn.Module`` types."""

from __future__ import annotations

import abc
from collections.abc import Collection, Mapping
from typing import Any, ClassVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["ArgumentRewrite", "graph_calls"]


class ArgumentRewrite(TorchFunctionMode, abc.ABC):
    """A thread-local rewrite of the functions in ``signatures`` (function -> its parameter names in order): a call
    of one of them goes to ``rewrite`` with its arguments bound by name; every other call, and one ``rewrite``
    declines (None), runs as it is."""

    signatures: ClassVar[Mapping[Any, tuple[str, ...]]] = {}

    @abc.abstractmethod
    def rewrite(self, bound: dict[str, Any]) -> Any:
        """The result of the call whose arguments are ``bound``, or None to run the call as it is."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        names = self.signatures.get(func)
        if names is not None:
            out = self.rewrite(dict(zip(names, args, strict=False)) | kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def graph_calls(module: nn.Module, targets: Collection[Any]) -> bool:
    """True when ``module`` or a submodule is an ``fx.GraphModule`` (an exported program's module) with a
    ``call_function`` node whose target is one of ``targets``."""
    return any(
        node.op == "call_function" and node.target in targets
        for sub in module.modules()
        if isinstance(sub, torch.fx.GraphModule)
        for node in sub.graph.nodes
    )
