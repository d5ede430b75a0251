"""The structured path's shortcuts run where they should, each can be switched off through ``StructuredOptions``,
and on or off they agree with the float64 reference in every mode."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import ntk_service.kernels.structured as structured_package
from ntk_service.kernels import KernelMode, compute_ntk
from ntk_service.kernels.blocks import run_blocks
from ntk_service.kernels.planning import plan_blocks
from ntk_service.kernels.problem.preparation import prepare_problem
from ntk_service.kernels.problem.private_module import eval_semantics
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.structured import FAST_PATHS, Structured, StructuredOptions
from tests.kernels.conftest import AUTOGRAD_CAPTURE, structured_ntk
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
    if mode.spec.pairs:  # the per-example blocks have their own contraction
        assert shared_deltas and torch.equal(shared_deltas[0], torch.eye(3, dtype=torch.float64))
    shared_deltas.clear()
    off = structured_ntk(model, x1, x2, mode, options=StructuredOptions(shared_delta=False))
    assert_matches(off, expected)
    assert not shared_deltas


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
    "mlp": lambda: nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 3)),
    "single linear": lambda: nn.Linear(5, 3),
    "in-place after the head": _ScaledInPlace,
    "residual after the head": _Residual,
    "head over positions": _SequenceHead,
}


@pytest.mark.parametrize("name", HEADS)
def test_batched_capture_of_models_with_and_without_a_linear_head_matches_reference(name: str) -> None:
    """The batched autograd capture where the output is a Linear's output, is modified after it, has a residual
    after it, or is a head over positions: exact in every mode."""
    build = HEADS[name]
    torch.manual_seed(0)
    model = build().double()
    width = 10 if name == "head over positions" else 5
    x1, x2 = torch.randn(6, width, dtype=torch.float64), torch.randn(4, width, dtype=torch.float64)
    _matches_reference_in_every_mode(model, x1, x2, AUTOGRAD_CAPTURE)


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
    "untouched": lambda: nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)),
    "in-place relu": lambda: nn.Sequential(nn.Linear(5, 7), nn.ReLU(inplace=True), nn.Linear(7, 3)),
    "view modified in place": _ViewModifiedInPlace,
}


@pytest.mark.parametrize("name", OUTPUTS)
def test_batched_capture_is_exact_when_outputs_are_modified_in_place(name: str) -> None:
    """Covered outputs modified in place after their call (an in-place ReLU, a view of one scaled): the batched
    capture differentiates at added probes, so the kernel is exact in every mode. The plan the first block made
    batch safe is a new one: the analysed plan is left as it was."""
    torch.manual_seed(0)
    model = OUTPUTS[name]().double()
    x1, x2 = torch.randn(6, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    alg = Structured(AUTOGRAD_CAPTURE)
    with eval_semantics(model) as module:
        problem, x1t, x2t = prepare_problem(module, x1, x2, params=None, dtype=torch.float64)
        first = alg.terms(problem)
        for mode in KernelMode:
            assert_matches(_run(alg, problem, x1t, x2t, mode), reference_ntk(model, x1, x2, mode.value))
        assert first.batch_safe is None  # never mutated
        assert alg.terms(problem).batch_safe is True


def _run(alg: Structured, problem: NtkProblem, x1: torch.Tensor, x2: torch.Tensor, mode: KernelMode) -> torch.Tensor:
    symmetric = not mode.spec.pairs
    plan = plan_blocks(alg, problem, x1.shape[0], x2.shape[0], mode, symmetric=symmetric, budget_bytes=2**30)
    return run_blocks(alg, problem, x1, None if symmetric else x2, mode, plan)


class _ResidualMlp(nn.Module):
    """An MLP with a skip connection: not a pure pipeline, so the autograd capture's case (NOTE [sequential
    chains]); its terms are plain factored ones."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.head = nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + torch.relu(self.hidden(x)))


JOINT = {  # model, per-example input shape, x2 examples
    "mlp, N = M": (_ResidualMlp, (5,), 6),
    "mlp, N != M": (_ResidualMlp, (5,), 4),
    "sequential chain (example-major δ), N = M": (
        lambda: nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)),
        (5,),
        6,
    ),
    "embedding, one token (ids), N = M": (
        lambda: nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(4, 3)),
        (1,),
        6,
    ),
    "conv (rule Jacobians), N = M": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 2)),
        (2, 6, 6),
        6,
    ),
}


@pytest.mark.parametrize("name", JOINT)
def test_joint_pass_takes_x1_and_x2_in_one_pass(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [joint pass]: both sides come from one pass over x1 then x2 (the inputs observed by a spy that passes
    them on); the kernel is exact."""
    passes: list[torch.Tensor] = []
    real = Structured.left

    def spy(self: Structured, problem: object, x: torch.Tensor) -> object:
        passes.append(x)
        return real(self, problem, x)  # type: ignore[arg-type]

    monkeypatch.setattr(Structured, "left", spy)
    build, shape, m = JOINT[name]
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
        assert torch.equal(x[:6], x1) and torch.equal(x[6:], x2)


def _matches_reference_in_every_mode(
    model: nn.Module, x1: torch.Tensor, x2: torch.Tensor, options: StructuredOptions
) -> None:
    for mode in KernelMode:
        theta = structured_ntk(model, x1, x2, mode, options=options)
        assert_matches(theta, reference_ntk(model, x1, x2, mode.value))


class _TinyCnn(nn.Module):
    """Two convolutions (a thin first patch, 2·3·3 < THIN_PATCH), biases, a Linear head: the conv passes,
    channels-last and thin-Jacobian paths."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.Conv2d(3, 4, 2)
        self.head = nn.Linear(4 * 2 * 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv2(torch.relu(self.conv1(x)))).flatten(1))


SWITCHED = {  # model, per-example input shape
    "chain mlp": (lambda: nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 3)), (5,)),
    "residual mlp": (_ResidualMlp, (5,)),
    "cnn": (_TinyCnn, (2, 6, 6)),
}


@functools.cache
def _switched_case(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, dict[tuple[str, bool], torch.Tensor]]:
    """The model, x1, x2 (4 examples each) and its float64 reference kernels by (mode, x2 given), made once."""
    build, shape = SWITCHED[name]
    torch.manual_seed(0)
    model = build().double()
    x1, x2 = torch.randn(4, *shape, dtype=torch.float64), torch.randn(4, *shape, dtype=torch.float64)
    expected = {(mode, given): reference_ntk(model, x1, x2 if given else None, mode) for mode, given in _SWITCHED_RUNS}
    return model, x1, x2, expected


_SWITCHED_RUNS = (("full", True), ("full", False), ("trace", True))


@pytest.mark.parametrize("path", FAST_PATHS)
@pytest.mark.parametrize("name", SWITCHED)
def test_every_fast_path_can_be_switched_off_and_the_kernel_stays_exact(name: str, path: str) -> None:
    """Each switch of ``StructuredOptions`` off, the others on: FULL (x2 given and omitted) and TRACE against the
    float64 reference."""
    model, x1, x2, expected = _switched_case(name)
    options = StructuredOptions().without(path)
    for mode, given in _SWITCHED_RUNS:
        theta = structured_ntk(model, x1, x2 if given else None, KernelMode(mode), options=options)
        assert_matches(theta, expected[mode, given])


def test_options_name_only_known_fast_paths() -> None:
    with pytest.raises(ValueError, match="unknown fast paths"):
        StructuredOptions().without("warp_drive")
    assert StructuredOptions().without("chain", "fold_bias") == StructuredOptions(chain=False, fold_bias=False)


def test_exported_members() -> None:
    """The subpackage's public surface is exactly its ``__all__`` (the submodules are its internals)."""
    expected = [
        "BATCHED_CAPTURE_WEIGHT",
        "FAST_PATHS",
        "NOMINAL_PARTNERS",
        "PER_EXAMPLE_CAPTURE_WEIGHT",
        "Structured",
        "StructuredOptions",
        "StructuredTerms",
        "structured_terms",
    ]
    assert structured_package.__all__ == expected
    for name in expected:
        assert getattr(structured_package, name) is not None
