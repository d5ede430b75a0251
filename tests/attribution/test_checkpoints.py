"""Checkpoints are checked against the model before any work (another architecture is a clear 4xx-class error) and
loaded into a copy; the output-function wrapper computes Σ_a w_a f_a for every input kind."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ntk_service.attribution.checkpoints import AllOutputs, OutputFunction, load_checkpoint, weighted_inputs
from ntk_service.errors import IncompatibleCheckpoint, InvalidInput, NonFiniteInput, UnsupportedModel


def _mlp(hidden: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))


def test_a_checkpoint_is_loaded_into_a_copy() -> None:
    model = _mlp()
    trained = _mlp()
    with torch.no_grad():
        trained[0].weight.add_(1.0)
    before = model[0].weight.clone()
    loaded = load_checkpoint(model, trained.state_dict(), index=0, operation="attribution")
    torch.testing.assert_close(loaded[0].weight, trained[0].weight)
    torch.testing.assert_close(model[0].weight, before)
    assert not loaded.training and loaded is not model


def test_a_checkpoint_of_another_architecture_is_refused_with_the_differences() -> None:
    wider = _mlp(hidden=16).state_dict()
    with pytest.raises(
        IncompatibleCheckpoint,
        match=r"checkpoint 2 does not fit the model \(Sequential\): '0.weight' "
        r"has shape \(16, 4\), the model's \(8, 4\)",
    ) as err:
        load_checkpoint(_mlp(), wider, index=2, operation="attribution")
    assert err.value.http_status == 422 and isinstance(err.value, InvalidInput)
    renamed = {f"net.{k}": v for k, v in _mlp().state_dict().items()}
    with pytest.raises(IncompatibleCheckpoint, match=r"missing \['0.weight'.*\(4\); unexpected \['net.0.weight'"):
        load_checkpoint(_mlp(), renamed, index=0, operation="attribution")


@pytest.mark.parametrize(
    ("checkpoint", "error", "match"),
    [
        ([1, 2, 3], IncompatibleCheckpoint, "is a list; expected a state dict"),
        ({**_mlp().state_dict(), "0.weight": [[0.0] * 4] * 8}, IncompatibleCheckpoint, "'0.weight' is a list"),
        ({**_mlp().state_dict(), "2.bias": torch.tensor([0.0, float("nan"), 0.0])}, NonFiniteInput, "'2.bias'"),
    ],
)
def test_malformed_checkpoints_are_refused(checkpoint: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        load_checkpoint(_mlp(), checkpoint, index=0, operation="attribution")  # type: ignore[arg-type]


def test_a_model_with_batchnorm_in_train_mode_is_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    with pytest.raises(UnsupportedModel, match="train mode"):
        load_checkpoint(model, None, index=0, operation="attribution")


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(2, 3)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(z)


def test_the_output_function_weights_the_outputs_for_every_input_kind() -> None:
    x, z, w = torch.randn(5, 4), torch.randn(5, 2), torch.randn(5, 3)
    plain = _mlp()
    torch.testing.assert_close(OutputFunction(plain)(*weighted_inputs(x, w)), (plain(x) * w).sum(1, keepdim=True))
    two = _TwoInputs()
    expected = (two(x, z) * w).sum(1, keepdim=True)
    torch.testing.assert_close(OutputFunction(two)(*weighted_inputs((x, z), w)), expected)
    torch.testing.assert_close(OutputFunction(two)(**weighted_inputs({"x": x, "z": z}, w)), expected)
    torch.testing.assert_close(AllOutputs(two)(x, z), two(x, z))
    assert [n for n, _ in OutputFunction(two).named_parameters()] == [n for n, _ in AllOutputs(two).named_parameters()]
