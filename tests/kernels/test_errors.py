"""Every bad input to compute_ntk gets a clear error whose message says what was expected and what came."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from ntk_service.errors import (
    EmptyBatch,
    InvalidInput,
    MemoryEstimateExceeded,
    NoMatchingParameters,
    NonFiniteInput,
    ShapeMismatch,
    UnknownImplementation,
    UnknownMode,
    UnsupportedModel,
)
from ntk_service.kernels import SideCache, compute_ntk
from ntk_service.kernels.problem.inputs import validate_inputs
from ntk_service.kernels.structured import Structured
from tests.reference import reference_ntk


@pytest.fixture
def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def test_wrong_feature_shape_names_the_shape(mlp: nn.Module) -> None:
    with pytest.raises(ShapeMismatch, match=r"per-example shape \(5,\)"):
        compute_ntk(mlp, torch.randn(2, 5))


def test_x1_x2_mismatch(mlp: nn.Module) -> None:
    with pytest.raises(ShapeMismatch, match=r"x2 has per-example shape \(3,\), x1 has \(4,\)"):
        compute_ntk(mlp, torch.randn(2, 4), torch.randn(2, 3))


def test_float_and_integer_sides_mismatch(mlp: nn.Module) -> None:
    with pytest.raises(ShapeMismatch, match="both as float or both as int"):
        compute_ntk(mlp, torch.randn(2, 4), torch.ones(2, 4, dtype=torch.int64))


@pytest.mark.parametrize("which", ["x1", "x2"])
def test_empty_batch(mlp: nn.Module, which: str) -> None:
    x, empty = torch.randn(2, 4), torch.randn(0, 4)
    args = (empty, x) if which == "x1" else (x, empty)
    with pytest.raises(EmptyBatch, match=f"{which} is an empty batch"):
        compute_ntk(mlp, *args)


def test_token_ids_outside_the_vocabulary_name_it() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2))
    with pytest.raises(InvalidInput, match=r"token ids in \[1, 12\] .*vocabulary of 10 \(ids 0\.\.9\)") as caught:
        compute_ntk(model, torch.tensor([[1, 2, 3], [4, 5, 12]]))
    assert not isinstance(caught.value, ShapeMismatch)  # the shape was right: it is the ids that are not


def test_scalar_input(mlp: nn.Module) -> None:
    with pytest.raises(ShapeMismatch, match="batch dimension"):
        compute_ntk(mlp, torch.tensor(1.0))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_names_the_example(mlp: nn.Module, bad: float) -> None:
    x = torch.randn(3, 4)
    x[2, 1] = bad
    with pytest.raises(NonFiniteInput, match="first in example 2"):
        compute_ntk(mlp, torch.randn(2, 4), x)


def test_unknown_mode_lists_the_valid_ones(mlp: nn.Module) -> None:
    with pytest.raises(UnknownMode, match="'diagonal'.*'full', 'trace', 'example_diagonal', 'output_diagonal'"):
        compute_ntk(mlp, torch.randn(2, 4), mode="diagonal")


def test_unknown_implementation(mlp: nn.Module) -> None:
    with pytest.raises(UnknownImplementation, match="'fastest'.*'jacobian_contraction'"):
        compute_ntk(mlp, torch.randn(2, 4), implementation="fastest")


def test_glob_matching_nothing_lists_the_parameters(mlp: nn.Module) -> None:
    with pytest.raises(NoMatchingParameters, match=r"'head\.\*' matches no parameter; the model has: 0.weight"):
        compute_ntk(mlp, torch.randn(2, 4), params=["head.*"])


def test_unsupported_dtype(mlp: nn.Module) -> None:
    with pytest.raises(InvalidInput, match="'float16' is not supported"):
        compute_ntk(mlp, torch.randn(2, 4), dtype="float16")


def test_batchnorm_in_train_mode_is_refused_and_eval_mode_works() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    with pytest.raises(UnsupportedModel, match=r"BatchNorm layer\(s\) \['1'\] are in train mode.*model.eval\(\)"):
        compute_ntk(model, x)
    model.eval()
    theta = compute_ntk(model, x, dtype=torch.float64).theta
    expected = reference_ntk(model, x)
    assert (theta - expected).abs().max() <= 1e-10 * expected.abs().max()


class _BatchCentering(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(dim=0, keepdim=True)


def test_interacting_examples_are_refused() -> None:
    model = nn.Sequential(nn.Linear(3, 4), _BatchCentering(), nn.Linear(4, 2))
    with pytest.raises(UnsupportedModel, match="examples interact"):
        compute_ntk(model, torch.randn(4, 3))


def test_model_with_wrong_output_batch_is_refused() -> None:
    class Pooled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum(0)

    with pytest.raises(UnsupportedModel, match="one output row per example"):
        compute_ntk(Pooled(), torch.randn(4, 3))


def test_one_example_without_its_batch_dimension_is_named_so() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    with pytest.raises(UnsupportedModel) as info:
        compute_ntk(model, torch.randn(4))  # one example of shape (4,), not a batch
    message = str(info.value)
    assert message.startswith("compute_ntk: x1 has shape (4,), whose first dimension is the batch (4 examples of ")
    assert "the model returned (3,)" in message
    assert "if (4,) is one example, pass x1.unsqueeze(0) (shape (1, 4)): inputs are batches (N, *input)" in message
    theta = compute_ntk(model, torch.randn(4).unsqueeze(0)).theta  # what the message says works
    assert theta.shape == (1, 1, 3, 3)


def test_not_a_module() -> None:
    with pytest.raises(UnsupportedModel, match="must be a torch.nn.Module, got function"):
        compute_ntk(lambda x: x, torch.randn(2, 3))  # type: ignore[arg-type]


def test_memory_refusal_carries_estimate_and_budget(mlp: nn.Module) -> None:
    with pytest.raises(MemoryEstimateExceeded) as info:
        compute_ntk(mlp, torch.randn(64, 4), mode="full", memory_budget_bytes=10_000)
    exc = info.value
    assert exc.budget_bytes == 10_000
    assert exc.estimate_bytes is not None and exc.estimate_bytes > 10_000
    assert "over the memory budget of 9.77 KiB" in exc.message
    assert "the result alone is 144.00 KiB" in exc.message  # 64 * 64 * 3 * 3 float32


def test_dropout_runs_in_eval_semantics_and_the_model_is_not_mutated() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Dropout(0.5), nn.Tanh(), nn.Linear(5, 2))
    model.train()
    x = torch.randn(4, 3)
    first = compute_ntk(model, x, dtype=torch.float64).theta
    second = compute_ntk(model, x, dtype=torch.float64).theta
    assert torch.equal(first, second)
    assert all(m.training for m in model.modules())
    expected = reference_ntk(model, x)  # the reference runs the model in eval mode
    assert (first - expected).abs().max() <= 1e-10 * expected.abs().max()
    assert model[0].weight.dtype == torch.float32


def test_side_cache_reuses_the_keyed_side(mlp: nn.Module) -> None:
    cache = SideCache(max_bytes=2**20)
    x1, x2 = torch.randn(3, 4), torch.randn(5, 4)
    first = compute_ntk(mlp, x1, x2, side_cache=cache, x2_key=("mlp", 1, "dataset"))
    assert len(cache) == 1 and cache.hits == 0
    second = compute_ntk(mlp, x1 + 1, x2, side_cache=cache, x2_key=("mlp", 1, "dataset"))
    assert cache.hits == 1
    assert not torch.equal(first.theta, second.theta)
    cold = compute_ntk(mlp, x1 + 1, x2, side_cache=SideCache(max_bytes=2**20), x2_key=("mlp", 1, "dataset"))
    assert torch.equal(second.theta, cold.theta)  # a reused side is the side computed afresh, bit for bit
    # without keys both sides come from one pass over x1 and x2 together: the same kernel up to rounding
    torch.testing.assert_close(second.theta, compute_ntk(mlp, x1 + 1, x2).theta)


@pytest.mark.parametrize("cache_bytes", [0, 2**20], ids=["disabled", "unkeyed"])
def test_a_cache_that_cannot_help_leaves_the_joint_pass_alone(
    mlp: nn.Module, cache_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """x1 and x2 without keys, or with keys and a disabled cache, take one joint pass and never touch the cache."""
    joint_calls = []
    real = Structured.joint_sides

    def spy(self: Structured, problem: object, x1: torch.Tensor, x2: torch.Tensor) -> object:
        joint_calls.append(x1.shape[0])
        return real(self, problem, x1, x2)  # type: ignore[arg-type]

    monkeypatch.setattr(Structured, "joint_sides", spy)
    cache = SideCache(max_bytes=cache_bytes)
    x1, x2 = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    keys = {"x1_key": ("m", 1, "a"), "x2_key": ("m", 1, "b")} if cache_bytes == 0 else {}
    theta = compute_ntk(mlp, x1, x2, implementation="structured", side_cache=cache, dtype="float64", **keys).theta
    assert joint_calls == [3]
    assert len(cache) == 0 and cache.hits == 0 and cache.misses == 0
    expected = reference_ntk(mlp, x1, x2)
    assert (theta - expected).abs().max() <= 1e-10 * expected.abs().max()
    compute_ntk(mlp, x1, x2, implementation="structured", side_cache=SideCache(2**20), x2_key=("m", 1, "b"))
    assert joint_calls == [3], "a keyed side with a working cache is computed on its own (cacheable) pass"


def test_side_cache_is_bounded() -> None:
    cache = SideCache(max_bytes=1000)
    cache.put("a", torch.zeros(100))  # 400 bytes
    cache.put("b", torch.zeros(100))
    cache.put("c", torch.zeros(100))
    assert cache.nbytes <= 1000 and cache.get("a") is None and cache.get("c") is not None
    cache.put("huge", torch.zeros(1000))
    assert cache.get("huge") is None


@pytest.mark.parametrize("implementation", ["jacobian_contraction", "ntk_vector_products", "structured"])
@pytest.mark.parametrize("train_mode", [False, True], ids=["eval", "train"])
def test_concurrent_calls_on_one_model_agree(implementation: str, train_mode: bool) -> None:
    """Threads sharing one model object (as the server's cached models are) never see each other's state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 2)).train(train_mode)
    x = torch.randn(6, 3)
    expected = reference_ntk(model, x)

    def kernel(_: int) -> torch.Tensor:
        return compute_ntk(model, x, implementation=implementation, dtype=torch.float64).theta

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(kernel, range(12)))
    # Not bitwise: concurrent BLAS calls may split their sums differently; a state mix-up is far off or raises.
    assert all((r - expected).abs().max() <= 1e-10 * expected.abs().max() for r in results)
    assert all(m.training is train_mode for m in model.modules())


def test_large_finite_input_is_not_refused(mlp: nn.Module) -> None:
    """The finite check sums in the input's dtype: a float32 sum that overflows is a false alarm it clears."""
    x = torch.full((2, 4), 3e38)
    assert not torch.isfinite(x.sum())
    _, x1, _ = validate_inputs(mlp, x, None, None)
    assert torch.equal(x1, x)
