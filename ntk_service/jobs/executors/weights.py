"""A model as it travels to Ray actors: its module tree with no data (every tensor on the meta device) and its
tensors as flat numpy byte arrays, which Ray's object store holds once per node and actors map zero-copy.

    skeleton, arrays = pack_module(model)              # the driver: ray.put(skeleton), ray.put(arrays)
    model = unpack_module(skeleton, arrays)            # an actor: tensors viewing the object store's memory

Pickling a module with its tensors copies every weight into the pickle, and each actor deserializes its own copy;
numpy arrays in the object store are mapped by every actor of a node from one shared copy. Tensors are shipped as
uint8 bytes with their dtype and shape (numpy has no bfloat16), and a tensor shared between modules (tied weights)
is packed once and is one tensor again after unpacking, so the kernel still counts it once.

NOTE [read-only weights]: the object store's buffers are read-only. ``unpack_module`` wraps them without a copy;
the engine never writes a module's tensors (NOTE [private module] in kernels/problem/private_module.py: a computation's
private copy shares them, ``functional_call`` swaps parameters in and out and reads them), and a GPU actor copies
them to its device. torch's warning about non-writable numpy arrays is silenced for that wrap only.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

__all__ = ["PackedTensor", "pack_module", "unpack_module"]


@dataclass(frozen=True, slots=True)
class PackedTensor:
    """How to rebuild one tensor from its bytes: the dtype's name (``str(torch.float32)``), shape, and whether it
    is a Parameter (and its ``requires_grad``)."""

    dtype: str
    shape: tuple[int, ...]
    parameter: bool
    requires_grad: bool


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every distinct parameter and buffer of ``model`` (a tied tensor once), in a stable order."""
    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if tensor is not None and id(tensor) not in seen:
                seen[id(tensor)] = tensor
    return list(seen.values())


def pack_module(model: nn.Module) -> tuple[nn.Module, list[tuple[PackedTensor, np.ndarray]]]:
    """Split a CPU module into a data-free skeleton and its tensors' bytes (no weight is copied on the driver
    beyond the bytes Ray puts in the object store).

    Args:
        model: a module whose tensors are on the CPU (the caller's is not changed).

    Returns:
        (skeleton, arrays): the module tree with every parameter and buffer replaced by a meta tensor of the same
        dtype and shape (tied tensors stay tied), and per distinct tensor its PackedTensor and a (bytes,) uint8
        numpy view of its data, in the order ``unpack_module`` expects.
    """
    tensors = _tensors(model)
    memo: dict[int, object] = {}
    arrays: list[tuple[PackedTensor, np.ndarray]] = []
    for tensor in tensors:
        data = tensor.detach().contiguous()
        meta = torch.empty_like(data, device="meta")
        parameter = isinstance(tensor, nn.Parameter)
        memo[id(tensor)] = nn.Parameter(meta, requires_grad=tensor.requires_grad) if parameter else meta
        packed = PackedTensor(str(data.dtype), tuple(data.shape), parameter, bool(tensor.requires_grad))
        arrays.append((packed, data.reshape(-1).view(torch.uint8).numpy()))
    skeleton = copy.deepcopy(model, memo)  # the memo stands in for every tensor: only the tree is copied
    return skeleton, arrays


def unpack_module(skeleton: nn.Module, arrays: list[tuple[PackedTensor, np.ndarray]]) -> nn.Module:
    """The module ``pack_module`` split, its tensors viewing ``arrays`` (no copy; NOTE [read-only weights]).

    Args:
        skeleton: the data-free module tree from ``pack_module`` (not changed).
        arrays: its tensors' bytes, as ``pack_module`` returned them (or Ray's read-only views of them).

    Returns:
        A module equal to the packed one: same tree, dtypes, shapes, values, tied tensors and requires_grad.

    Raises:
        ValueError: ``arrays`` does not match the skeleton (another model's, or a different count).
    """
    metas = _tensors(skeleton)
    if len(metas) != len(arrays):
        raise ValueError(f"unpack_module: the skeleton has {len(metas)} tensors, the arrays {len(arrays)}")
    memo: dict[int, object] = {}
    for meta, (packed, raw) in zip(metas, arrays, strict=True):
        if str(meta.dtype) != packed.dtype or tuple(meta.shape) != packed.shape:
            raise ValueError(
                f"unpack_module: a tensor of the skeleton is {meta.dtype} {tuple(meta.shape)}, its bytes are "
                f"{packed.dtype} {packed.shape}: the arrays are another model's"
            )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            flat = torch.from_numpy(raw)
        tensor = flat.view(meta.dtype).reshape(packed.shape)
        memo[id(meta)] = nn.Parameter(tensor, requires_grad=packed.requires_grad) if packed.parameter else tensor
    return copy.deepcopy(skeleton, memo)
