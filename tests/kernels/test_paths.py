"""describe_paths: the path each parameter takes and why, and AUTO's choice, read from the structured engine's plan."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ntk_service.kernels.paths import describe_paths
from ntk_service.kernels.structured import algorithm as structured_algorithm


class Mixed(nn.Module):
    """A Linear layer, an elementwise gate, a LayerNorm, a parameter divided into (no rule) and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.gate = nn.Parameter(torch.randn(6))
        self.norm = nn.LayerNorm(6)
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.lin(x)) * self.gate) / self.temperature)


def test_every_parameter_has_a_path_its_ops_and_a_reason() -> None:
    torch.manual_seed(0)
    report = describe_paths(Mixed(), torch.randn(4, 4), n=64)
    forms = {p.name: (p.form, p.ops) for p in report.parameters}
    assert forms == {
        "gate": ("jacobian", ("mul",)),
        "temperature": ("jacrev", ("div",)),
        "lin.weight": ("factored", ("linear",)),
        "lin.bias": ("factored", ("linear",)),
        "norm.weight": ("jacobian", ("layer_norm",)),
        "norm.bias": ("jacobian", ("layer_norm",)),
        "head.weight": ("factored", ("linear",)),
        "head.bias": ("factored", ("linear",)),
    }
    reasons = {p.name: p.reason for p in report.parameters}
    assert "div" in reasons["temperature"] and "no structure rule" in reasons["temperature"]
    assert "J never formed" in reasons["lin.weight"] and "normalisation" in reasons["norm.weight"]
    public = report.to_public()
    assert public["jacrev_parameters"] == 1 and public["structured_parameters"] == 4 * 6 + 6 + 6 + 12 + 18 + 3
    assert [(g["group"], g["parameters"], g["path"]) for g in public["groups"]] == [
        ("", ["gate"], "structured"),
        ("", ["temperature"], "autograd"),
        ("lin", ["weight", "bias"], "structured"),
        ("norm", ["weight", "bias"], "structured"),
        ("head", ["weight", "bias"], "structured"),
    ]
    assert report.capture.startswith("per example") and "autograd" in report.capture  # the jacrev parameter
    assert public["auto"]["n"] == 64 and public["auto"]["implementation"] in public["auto"]["estimated_gflop"]


def test_a_large_output_is_described_without_running_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """The report learns how the engine would capture from two forwards; it never captures k cotangents (a language
    model's k is its vocabulary)."""

    def refuse(*args: object) -> None:
        raise AssertionError("describe_paths ran a capture")

    monkeypatch.setattr(structured_algorithm, "capture", refuse)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 20_000))
    report = describe_paths(model, torch.randn(2, 4))
    assert report.capture.startswith("chain") and [p.form for p in report.parameters] == ["factored"] * 4


class DataDependent(nn.Module):
    """A branch on a tensor's value: torch.func.vmap refuses it, so every implementation goes example by example."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x) if bool((x > -1e6).all()) else -self.lin(x)  # always the first branch
        return out


def test_a_model_vmap_refuses_is_reported_on_the_per_example_loop() -> None:
    report = describe_paths(DataDependent(), torch.randn(3, 3))
    assert [p.form for p in report.parameters] == ["jacrev", "jacrev"]
    assert report.capture.startswith("per-example loop") and report.auto.implementation == "jacobian_contraction"
