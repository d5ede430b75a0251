"""NOTE [sequential chains]: plain Sequential models are captured in closed form, exactly, and only those."""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest
import torch
from torch import nn

from ntk_service.kernels import KernelMode, compute_ntk
from ntk_service.kernels.structured import StructuredOptions
from ntk_service.kernels.structured import algorithm as structured_algorithm
from ntk_service.kernels.structured import capture as structured_capture
from ntk_service.kernels.structured.contraction import Accumulator
from ntk_service.registry.architectures import MlpConfig
from ntk_service.registry.families import MLP
from tests.kernels.conftest import AUTOGRAD_CAPTURE, structured_ntk
from tests.reference import assert_matches, reference_ntk


def _activations() -> nn.Module:
    """Every pointwise step the chain knows, a flatten in front, a bias-less Linear, an activation at the end."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(6, 7),
        nn.Tanh(),
        nn.Linear(7, 7),
        nn.Sigmoid(),
        nn.Linear(7, 8),
        nn.GELU(approximate="tanh"),
        nn.Linear(8, 8),
        nn.SiLU(),
        nn.Linear(8, 6),
        nn.LeakyReLU(0.2),
        nn.Linear(6, 6),
        nn.ELU(0.7),
        nn.Linear(6, 6),
        nn.Softplus(beta=2.0, threshold=1.0),
        nn.Dropout(0.3),
        nn.Identity(),
        nn.Linear(6, 5, bias=False),
        nn.ReLU(inplace=True),
        nn.Linear(5, 3),
        nn.GELU(),
    )


def _shared_twice() -> nn.Module:
    shared = nn.Linear(4, 4)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), shared, nn.ReLU(), shared, nn.Linear(4, 3))


class _Between(nn.Module):
    """Linear, Tanh, ``between``, Linear in a forward declared fixed: a chain exactly when ``between`` does nothing
    to the tensor."""

    ntk_fixed_pipeline = True

    def __init__(self, between: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.first, self.act, self.head, self.between = nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), between

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.between(self.act(self.first(x))))


_MLP_CONFIG = MlpConfig(family="mlp", input_dim=5, hidden=[7, 6], output_dim=3, activation="gelu")


def _registry_mlp() -> nn.Module:
    return MLP(_MLP_CONFIG)


CHAINS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], list[str] | None]] = {
    "relu mlp": (
        lambda: nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 7), nn.ReLU(), nn.Linear(7, 3)),
        (5,),
        None,
    ),
    "every activation": (_activations, (2, 3), None),
    "nested, Linear after Linear": (
        lambda: nn.Sequential(nn.Sequential(nn.Linear(5, 7), nn.Tanh()), nn.Linear(7, 4), nn.Linear(4, 3)),
        (5,),
        None,
    ),
    "one Linear called twice": (_shared_twice, (5,), None),
    "two Linear layers (δ shared by all examples)": (
        lambda: nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3)),
        (5,),
        None,
    ),
    "a shared, non-diagonal δ after other terms": (
        lambda: nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 3)),
        (5,),
        None,
    ),
    "middle layers only": (_activations, (2, 3), ["3.*", "17.*"]),
    "the registry's MLP family (a loop over a ModuleList)": (_registry_mlp, (5,), None),
    "a forward of its own, nothing in between": (lambda: _Between(lambda h: h), (5,), None),
}


@pytest.mark.parametrize("capture", ["chain", "autograd"])
@pytest.mark.parametrize("name", CHAINS)
def test_chain_matches_reference(name: str, capture: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both captures of each chain agree with the float64 reference in every mode, x2 given or not; the chain is
    the one taken unless turned off (``StructuredOptions.chain``)."""
    options = AUTOGRAD_CAPTURE if capture == "autograd" else StructuredOptions()
    chained = _count_chain_runs(monkeypatch)
    build, shape, params = CHAINS[name]
    torch.manual_seed(0)
    model = build().double()
    x1, x2 = torch.randn(6, *shape, dtype=torch.float64), torch.randn(4, *shape, dtype=torch.float64)
    for mode in KernelMode:
        for other in (x2, None):
            theta = structured_ntk(model, x1, other, mode, options=options, params=params)
            expected = reference_ntk(model, x1, other, mode.value, params)
            assert_matches(theta, expected)
    assert (len(chained) > 0) == (capture == "chain")


class _CustomForward(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x) * 2.0


def _hooked() -> nn.Module:
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    model[1].register_forward_hook(lambda module, args, output: output * 3.0)
    return model


def _patched_activation() -> nn.Module:
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    model[1].forward = torch.sin  # type: ignore[method-assign]  # accelerate's hooks replace forward like this
    return model


def _patched_root() -> nn.Module:
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    doubled = types.MethodType(lambda self, x: 2.0 * nn.Sequential.forward(self, x), model)
    model.forward = doubled  # type: ignore[method-assign]
    return model


def _weight_not_a_parameter(as_buffer: bool) -> nn.Module:
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    weight = model[2].weight.detach().double()  # .double() on the model converts parameters and buffers only
    del model[2].weight
    if as_buffer:
        model[2].register_buffer("weight", weight)
    else:
        model[2].weight = weight
    return model


class _Undeclared(MLP):
    """The registry's MLP forward, not declared fixed: it could read a flag, so it is not traced once and trusted."""

    ntk_fixed_pipeline = False


class _CallOverride(nn.Sequential):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return super().__call__(x) * 2.0


class _Positions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).sum(1)


NOT_CHAINS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "Sequential subclass with its own forward": (
        lambda: _CustomForward(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)),
        (5,),
    ),
    "a forward hook on an activation": (_hooked, (5,)),
    "a LayerNorm in the chain": (lambda: nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3)), (5,)),
    "Linear over positions": (lambda: nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Flatten()), (2, 5)),
    "a Sequential inside another module, then a sum": (_Positions, (2, 5)),
    "a reshape by the batch size between the layers": (lambda: _Between(lambda h: h.reshape(h.shape[0], -1)), (5,)),
    "a constant added between the layers": (lambda: _Between(lambda h: h + 1.0), (5,)),
    "a forward of its own, not declared fixed": (lambda: _Undeclared(_MLP_CONFIG), (5,)),
    "__call__ overridden": (lambda: _CallOverride(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)), (5,)),
    "an activation's forward set on the instance": (_patched_activation, (5,)),
    "the Sequential's forward set on the instance": (_patched_root, (5,)),
    "a weight that is a buffer": (lambda: _weight_not_a_parameter(as_buffer=True), (5,)),
    "a weight that is a plain tensor": (lambda: _weight_not_a_parameter(as_buffer=False), (5,)),
}


@pytest.mark.parametrize("name", NOT_CHAINS)
def test_chain_is_not_taken_where_it_would_not_be_the_model(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    chained = _count_chain_runs(monkeypatch)
    build, shape = NOT_CHAINS[name]
    torch.manual_seed(0)
    model = build().double()
    x1, x2 = torch.randn(6, *shape, dtype=torch.float64), torch.randn(4, *shape, dtype=torch.float64)
    for mode in (KernelMode.FULL, KernelMode.EXAMPLE_DIAGONAL):
        theta = compute_ntk(model, x1, x2, mode=mode, implementation="structured").theta
        expected = reference_ntk(model, x1, x2, mode.value)
        assert_matches(theta, expected)
    assert not chained


def test_chain_steps_aside_while_a_global_hook_is_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hooks are checked per capture: a global forward hook registered after the first call is honoured."""
    chained = _count_chain_runs(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x1 = torch.randn(6, 5, dtype=torch.float64)
    compute_ntk(model, x1, implementation="structured")
    assert len(chained) == 1

    def hook(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor | None:
        return output * 2.0 if isinstance(module, nn.Tanh) else None

    handle = nn.modules.module.register_module_forward_hook(hook)
    try:
        theta = compute_ntk(model, x1, implementation="structured").theta
        expected = reference_ntk(model, x1)
    finally:
        handle.remove()
    assert_matches(theta, expected)
    assert len(chained) == 1


def _count_chain_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one per ``run_chain`` call (a spy that only counts: it calls the real one)."""
    runs: list[int] = []
    real = structured_capture.run_chain

    def spy(*args: object) -> object:
        runs.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(structured_capture, "run_chain", spy)
    return runs


@pytest.mark.parametrize("capture", ["chain", "autograd"])
def test_accumulator_memory_follows_the_captures_delta(capture: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [accumulator memory]: the chain's δ lies example-major and so does the FULL accumulator; the autograd
    capture's δ lies output-major and so does the accumulator. Either way the kernel is exact."""
    options = AUTOGRAD_CAPTURE if capture == "autograd" else StructuredOptions()
    accumulators: list[Accumulator] = []
    real = structured_algorithm.finish_with_factored

    def spy(acc: Accumulator, *args: object, **kwargs: object) -> torch.Tensor:
        accumulators.append(acc)  # observed, passed on
        return real(acc, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(structured_algorithm, "finish_with_factored", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 7), nn.ReLU(), nn.Linear(7, 3)).double()
    x1, x2 = torch.randn(6, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    theta = structured_ntk(model, x1, x2, KernelMode.FULL, options=options)
    expected = reference_ntk(model, x1, x2)
    assert_matches(theta, expected)
    (acc,) = accumulators
    assert acc.tensor.shape == (3, 6, 3, 4)  # (c, i, d, j) either way
    if capture == "chain":
        assert acc.example_major and acc.tensor.permute(1, 0, 3, 2).is_contiguous() and not acc.tensor.is_contiguous()
    else:
        assert not acc.example_major and acc.tensor.is_contiguous()
    off = structured_ntk(model, x1, x2, KernelMode.FULL, options=options.without("example_major_accumulator"))
    assert_matches(off, expected)
    assert not accumulators[-1].example_major
