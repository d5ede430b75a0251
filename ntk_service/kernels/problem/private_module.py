"""The private module a kernel computes on (NOTE [private module]): refusing models without a per-example NTK,
copying the module tree so concurrent calls never see each other's tensors, and eval semantics without touching
the caller's module."""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from ntk_service.errors import UnsupportedModel

__all__ = ["check_model", "eval_semantics", "private_copy"]

_BATCHNORM_TYPES = (nn.modules.batchnorm._BatchNorm,)


_MODULE_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.Lock] = weakref.WeakKeyDictionary()
_MODULE_LOCKS_GUARD = threading.Lock()


def _module_lock(module: nn.Module) -> threading.Lock:
    with _MODULE_LOCKS_GUARD:
        return _MODULE_LOCKS.setdefault(module, threading.Lock())


def _structural_copy(module: nn.Module) -> nn.Module | None:
    """A copy of the module tree that shares every parameter and buffer tensor (no weights copied), or None."""
    shared = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    try:
        return copy.deepcopy(module, shared)
    except Exception:  # a module holding something uncopyable (a lock, a file): use the original, serialized
        return None


def check_model(module: object) -> None:
    """Refuse what has no per-example NTK before any work.

    Raises:
        UnsupportedModel: not an nn.Module, or a BatchNorm layer is in train mode (batch statistics couple the
        examples).
    """
    if not isinstance(module, nn.Module):
        raise UnsupportedModel(f"compute_ntk: model must be a torch.nn.Module, got {type(module).__name__}")
    if any(isinstance(m, _BATCHNORM_TYPES) and m.training for m in module.modules()):
        in_train = [name for name, m in module.named_modules() if isinstance(m, _BATCHNORM_TYPES) and m.training]
        raise UnsupportedModel(
            f"compute_ntk: BatchNorm layer(s) {in_train[:3]} are in train mode, where batch statistics couple the "
            "examples and the per-example kernel is undefined; call model.eval() first (running statistics are used)"
        )


def private_copy(module: nn.Module) -> nn.Module | None:
    """An eval-mode structural copy of ``module`` sharing every tensor (see NOTE [private module]), or None when
    the module cannot be copied."""
    private = _structural_copy(module)
    return None if private is None else private.eval()


@contextlib.contextmanager
def eval_semantics(module: nn.Module) -> Iterator[nn.Module]:
    """Yield a private eval-mode view of ``module`` (dropout off); the caller's module is never touched.

    NOTE [private module]: ``functional_call`` swaps a module's parameters in place for the duration of a call and
    the structured path reads ``module._parameters``, so two threads computing on one module object (the server's
    cached models) would see each other's tensors. Each call therefore works on a structural copy that shares the
    parameter and buffer tensors (cheap: module objects only; ``problem_pool`` keeps them across calls). A module
    that cannot be copied is used itself, under a per-module lock, flipped to eval and restored afterwards, and so
    are its plain tensor attributes: the old ``torch.nn.utils.weight_norm`` (the usual reason a module cannot be
    copied) sets ``weight`` in a forward pre-hook, which under ``vmap`` would leave a functorch wrapper behind.

    Raises:
        UnsupportedModel: see ``check_model``.
    """
    check_model(module)
    private = private_copy(module)
    if private is not None:
        yield private
        return
    with _module_lock(module):
        flags = [(m, m.training) for m in module.modules()]
        attributes = [(m, _tensor_attributes(m)) for m in module.modules()]
        module.eval()
        try:
            yield module
        finally:
            for m, was_training in flags:
                m.training = was_training
            for m, tensors in attributes:
                for name in _tensor_attributes(m).keys() - tensors.keys():
                    delattr(m, name)
                vars(m).update(tensors)


def _tensor_attributes(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's plain tensor attributes (not parameters or buffers, which live in their own dicts)."""
    return {name: value for name, value in vars(module).items() if isinstance(value, torch.Tensor)}
