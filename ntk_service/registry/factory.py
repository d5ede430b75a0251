"""Operator-allowed model factories: ``"package.module:function"`` called with JSON keyword arguments.

This is the only place where a client's request leads to Python code running, and only code the operator chose: the
``factory`` string must be listed verbatim in ``allowed_factories`` (``NTK_MODEL_FACTORIES``) before anything is
imported. The kwargs are parsed JSON (numbers, strings, lists, dicts); nothing is unpickled or evaluated.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from ntk_service.errors import InvalidInput, PermissionDenied
from ntk_service.registry.architectures import FactoryConfig

__all__ = ["call_factory", "probe_output_dim"]


def call_factory(config: FactoryConfig, allowed_factories: frozenset[str]) -> nn.Module:
    """Import and call an allowed factory.

    Args:
        config (FactoryConfig): the validated architecture.
        allowed_factories (frozenset[str]): the operator's allow list of ``"module:function"`` strings.

    Returns:
        The nn.Module the factory returned (not yet in eval mode).

    Raises:
        PermissionDenied: the factory is not in the allow list.
        InvalidInput: it cannot be imported, the call fails (e.g. unexpected kwargs) or it returns no nn.Module.
    """
    if config.factory not in allowed_factories:
        allowed = ", ".join(sorted(allowed_factories)) or "none"
        raise PermissionDenied(
            detail=f"factory {config.factory!r} is not allowed on this server (allowed: {allowed}); "
            "the operator must add it to NTK_MODEL_FACTORIES"
        )
    module_name, _, func_name = config.factory.partition(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
    except (ImportError, AttributeError) as exc:
        raise InvalidInput(
            detail=f"factory {config.factory!r} is allowed but cannot be imported ({exc}); "
            "the operator must install the package that defines it"
        ) from exc
    try:
        model = func(**config.kwargs)
    except Exception as exc:  # the factory is operator code; any failure is reported, never a 500
        raise InvalidInput(
            detail=f"factory {config.factory!r} failed with kwargs {config.kwargs!r}: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(model, nn.Module):
        raise InvalidInput(
            detail=f"factory {config.factory!r} returned {type(model).__name__}, expected a torch.nn.Module"
        )
    return model


def probe_output_dim(model: nn.Module, config: FactoryConfig) -> int:
    """Outputs per example k = prod(out) of a factory model, from one forward pass on a zero example.

    Returns:
        k, where the model maps (1, *input_shape) to (1, *out).

    Raises:
        InvalidInput: the forward pass fails or returns no (1, ...) floating tensor.
    """
    dtype = torch.int64 if config.input_dtype == "int64" else torch.float32
    x = torch.zeros((1, *config.input_shape), dtype=dtype)
    try:
        with torch.no_grad():
            out = model(x)
    except Exception as exc:  # operator code, reported as the client's config being wrong for it
        raise InvalidInput(
            detail=f"factory model fails on an input of shape {tuple(x.shape)} {config.input_dtype}: "
            f"{type(exc).__name__}: {exc}; check input_shape and input_dtype"
        ) from exc
    ok = isinstance(out, torch.Tensor) and out.ndim >= 1 and out.shape[0] == 1 and out.is_floating_point()
    if not ok or out[0].numel() == 0:
        got = f"{type(out).__name__}" + (f" {tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else "")
        raise InvalidInput(
            detail=f"factory model must map a batch (1, *input_shape) to a floating tensor (1, *out), got {got}"
        )
    return int(out[0].numel())
