"""A model as it travels to Ray actors (jobs/executors/weights.py): a data-free module tree plus its tensors'
bytes as numpy, rebuilt on the actor as tensors viewing those bytes (zero-copy), equal to the original."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch import nn

from ntk_service.jobs.executors.weights import pack_module, unpack_module
from tests.reference import reference_ntk


class _Tied(nn.Module):
    """Tied weights (one Linear's weight in two modules), a bfloat16 buffer and a non-persistent buffer: what a
    state_dict round trip would get wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(3, 4, bias=False)
        self.mid = nn.Linear(4, 4)
        self.back = nn.Linear(4, 3, bias=False)
        self.again = nn.Linear(3, 4, bias=False)
        self.again.weight = self.emb.weight  # tied: one tensor, two modules
        self.register_buffer("scale", torch.tensor([1.5, 0.5, 2.0], dtype=torch.bfloat16))
        self.register_buffer("shift", torch.tensor(0.25), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.back(torch.tanh(self.mid(self.emb(x))))
        return self.back(torch.tanh(self.mid(self.again(y)))) * self.scale.to(x.dtype) + self.shift


def _read_only(arrays: list) -> list:  # as Ray hands them to an actor: read-only views of the object store
    out = []
    for packed, raw in arrays:
        view = raw.view()
        view.setflags(write=False)
        out.append((packed, view))
    return out


def test_a_packed_module_unpacks_equal_tied_and_zero_copy() -> None:
    torch.manual_seed(0)
    model = _Tied().double()
    model.register_buffer("scale", torch.tensor([1.5, 0.5, 2.0], dtype=torch.bfloat16))  # .double() cast it
    skeleton, arrays = pack_module(model)
    assert all(t.device.type == "meta" for t in (*skeleton.parameters(), *skeleton.buffers()))
    assert len(pickle.dumps(skeleton)) < 10_000  # the tree carries no weight bytes
    arrays = _read_only(pickle.loads(pickle.dumps(arrays)))  # a copy, as the object store holds it
    rebuilt = unpack_module(skeleton, arrays)
    assert rebuilt.again.weight is rebuilt.emb.weight  # still tied: counted once by the kernel
    assert len(list(rebuilt.parameters())) == len(list(model.parameters()))
    assert rebuilt.scale.dtype == torch.bfloat16 and rebuilt.shift.item() == 0.25
    for (name, got), (_, want) in zip(rebuilt.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(got, want), name
    pointers = {raw.__array_interface__["data"][0] for _, raw in arrays}
    assert {t.data_ptr() for t in (*rebuilt.parameters(), *rebuilt.buffers())} <= pointers  # no copy
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((5, 3)))
    np.testing.assert_array_equal(reference_ntk(rebuilt, x, mode="full"), reference_ntk(model, x, mode="full"))


def test_arrays_of_another_model_are_refused() -> None:
    skeleton, _ = pack_module(nn.Linear(3, 2))
    _, other = pack_module(nn.Linear(3, 4))
    with pytest.raises(ValueError, match="unpack_module: a tensor of the skeleton is torch.float32 \\(2, 3\\)"):
        unpack_module(skeleton, other)
    with pytest.raises(ValueError, match="the skeleton has 2 tensors, the arrays 1"):
        unpack_module(skeleton, other[:1])


def test_a_frozen_parameter_stays_frozen() -> None:
    layer = nn.Linear(3, 2)
    layer.bias.requires_grad_(False)
    rebuilt = unpack_module(*pack_module(layer))
    assert isinstance(rebuilt.bias, nn.Parameter) and rebuilt.bias.requires_grad is False
    assert rebuilt.weight.requires_grad is True and torch.equal(rebuilt.weight, layer.weight)
