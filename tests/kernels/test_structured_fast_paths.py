"""The structured path's shortcuts run where they should and agree with the float64 reference in every mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ntk_service.kernels import KernelMode, compute_ntk, structured_capture
from ntk_service.kernels.structured import Structured
from tests.reference import assert_matches, reference_ntk


@pytest.mark.parametrize("mode", list(KernelMode), ids=str)
def test_output_layer_delta_shared_by_all_examples_is_contracted_as_an_outer_product(
    mode: KernelMode, shared_deltas: list[torch.Tensor]
) -> None:
    """NOTE [example-independent δ]: the last Linear's δ is e_c for every example; its term is Δ ⊗ G^A."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x1, x2 = torch.randn(6, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    theta = compute_ntk(model, x1, x2, mode=mode, implementation="structured").theta
    expected = reference_ntk(model, x1, x2, mode.value)
    assert_matches(theta, expected)
    if mode is not KernelMode.EXAMPLE_DIAGONAL:  # the diagonal has its own contraction
        assert shared_deltas and torch.equal(shared_deltas[0], torch.eye(3, dtype=torch.float64))


class _ScaledInPlace(nn.Module):
    """The head's output modified in place after the call: not the head's output any more."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Sequential(nn.Linear(5, 7), nn.Tanh()), nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(self.body(x))
        return y.mul_(2.0)


class _Residual(nn.Module):
    """Something added after the head."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Sequential(nn.Linear(5, 3), nn.Tanh()), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(h) + h


class _SequenceHead(nn.Module):
    """A head over positions: (n, T, in) -> (n, T, out), k = T·out."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Sequential(nn.Linear(5, 6), nn.GELU()), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x.view(x.shape[0], 2, 5)))


HEADS = {
    "mlp": (lambda: nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 3)), True),
    "single linear": (lambda: nn.Linear(5, 3), True),
    "in-place after the head": (_ScaledInPlace, False),
    "residual after the head": (_Residual, False),
    "head over positions": (_SequenceHead, False),
}


@pytest.mark.parametrize("name", HEADS)
@pytest.mark.usefixtures("autograd_capture")
def test_linear_head_starts_the_reverse_pass_only_where_the_output_is_the_heads(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [linear head]: taken exactly when the model's output is a Linear's output; the kernel is exact."""
    taken: list[bool] = []
    real = structured_capture._linear_head

    def spy(*args: object) -> torch.Tensor | None:
        head = real(*args)  # type: ignore[arg-type]
        taken.append(head is not None)
        return head

    monkeypatch.setattr(structured_capture, "_linear_head", spy)
    build, expected_taken = HEADS[name]
    torch.manual_seed(0)
    model = build().double()
    width = 10 if name == "head over positions" else 5
    x1, x2 = torch.randn(6, width, dtype=torch.float64), torch.randn(4, width, dtype=torch.float64)
    _matches_reference_in_every_mode(model, x1, x2)
    assert taken and all(t == expected_taken for t in taken)


class _ViewModifiedInPlace(nn.Module):
    """A view of a hidden layer's output is modified in place (its version counter is shared with the output)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.head = nn.Linear(5, 7), nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        h[:, :2].mul_(3.0)
        return self.head(torch.tanh(h))


OUTPUTS = {
    "untouched": (lambda: nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)), False),
    "in-place relu": (lambda: nn.Sequential(nn.Linear(5, 7), nn.ReLU(inplace=True), nn.Linear(7, 3)), True),
    "view modified in place": (_ViewModifiedInPlace, True),
}


@pytest.mark.parametrize("name", OUTPUTS)
@pytest.mark.usefixtures("autograd_capture")
def test_outputs_are_their_own_probes_until_one_is_modified_in_place(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [outputs as probes]: an in-place change of a covered output switches the plan to added probes (the
    first capture reruns) and the kernel stays exact."""
    probing: list[bool] = []
    real = structured_capture._capture_batched_once

    def spy(problem: object, plan: structured_capture.StructurePlan, x: torch.Tensor) -> object:
        probing.append(plan.probe_outputs)
        return real(problem, plan, x)  # type: ignore[arg-type]

    monkeypatch.setattr(structured_capture, "_capture_batched_once", spy)
    build, modified = OUTPUTS[name]
    torch.manual_seed(0)
    model = build().double()
    x1, x2 = torch.randn(6, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    _matches_reference_in_every_mode(model, x1, x2)
    assert probing[0] is False  # every plan starts with the outputs as probes
    assert all(probing[1:]) if modified else not any(probing)
    assert len(probing) == len(KernelMode) + (1 if modified else 0)


class _ResidualMlp(nn.Module):
    """An MLP with a skip connection: not a pure pipeline, so the autograd capture's case (NOTE [sequential
    chains]); its terms are plain factored ones."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.head = nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + torch.relu(self.hidden(x)))


JOINT = {  # model, per-example input shape, x2 examples, whether the joint pass interleaves x1 and x2
    "mlp, N = M": (_ResidualMlp, (5,), 6, True),
    "mlp, N != M": (_ResidualMlp, (5,), 4, False),
    "sequential chain (example-major δ), N = M": (
        lambda: nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)),
        (5,),
        6,
        False,
    ),
    "embedding, one token (ids), N = M": (
        lambda: nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(4, 3)),
        (1,),
        6,
        True,
    ),
    "conv (rule Jacobians), N = M": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 2)),
        (2, 6, 6),
        6,
        False,
    ),
}


@pytest.mark.parametrize("name", JOINT)
def test_joint_pass_interleaves_x1_and_x2_only_where_the_contraction_reads_the_slices_in_place(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [interleaved joint pass]: plain factored sides come from x1[0], x2[0], x1[1], ...; the kernel is exact."""
    passes: list[torch.Tensor] = []
    real = Structured.left

    def spy(self: Structured, problem: object, x: torch.Tensor) -> object:
        passes.append(x)
        return real(self, problem, x)  # type: ignore[arg-type]

    monkeypatch.setattr(Structured, "left", spy)
    build, shape, m, interleaved = JOINT[name]
    torch.manual_seed(0)
    model = build().double()
    if name.startswith("embedding"):
        x1, x2 = torch.randint(0, 10, (6, *shape)), torch.randint(0, 10, (m, *shape))
    else:
        x1, x2 = torch.randn(6, *shape, dtype=torch.float64), torch.randn(m, *shape, dtype=torch.float64)
    for mode in (KernelMode.FULL, KernelMode.TRACE, KernelMode.OUTPUT_DIAGONAL):
        passes.clear()
        theta = compute_ntk(model, x1, x2, mode=mode, implementation="structured").theta
        expected = reference_ntk(model, x1, x2, mode.value)
        assert_matches(theta, expected)
        (x,) = passes  # one pass for both sides
        if interleaved:
            assert torch.equal(x[0::2], x1) and torch.equal(x[1::2], x2)
        else:
            assert torch.equal(x[:6], x1) and torch.equal(x[6:], x2)


def _matches_reference_in_every_mode(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor) -> None:
    for mode in KernelMode:
        theta = compute_ntk(model, x1, x2, mode=mode, implementation="structured").theta
        assert_matches(theta, reference_ntk(model, x1, x2, mode.value))
