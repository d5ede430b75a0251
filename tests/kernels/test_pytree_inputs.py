"""Tuple and mapping inputs and the ``output=`` selector through compute_ntk, against the float64 reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from ntk_service.errors import InvalidInput, ShapeMismatch, UnsupportedModel
from ntk_service.kernels import (
    KernelMode,
    NtkImplementation,
    compute_nngp,
    compute_ntk,
    compute_ntk_groups,
    monte_carlo_ntk,
    ntk_operator,
)
from ntk_service.kernels.choice import ALGORITHMS
from ntk_service.kernels.problem.outputs import parse_output, select_output
from tests.reference import assert_matches, reference_ntk

IMPLEMENTATIONS = [*ALGORITHMS, NtkImplementation.AUTO]
VOCAB = 11


class TokenModel(nn.Module):
    """Keyword inputs (ids, an integer mask, a float feature) and a dict output, like a masked LM's."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 5)
        self.lin = nn.Linear(5, 3)
        self.side = nn.Linear(2, 3)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, extra: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.emb(input_ids)) * attention_mask.unsqueeze(-1)
        return {"logits": self.lin(h) + self.side(extra).unsqueeze(1), "hidden": h}


def _token_inputs(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, 6, dtype=torch.int64)
    mask[:, 4:] = torch.randint(0, 2, (n, 2), generator=g)
    return {
        "input_ids": torch.randint(0, VOCAB, (n, 6), generator=g),
        "attention_mask": mask,
        "extra": torch.randn(n, 2, generator=g, dtype=torch.float64),
    }


@pytest.fixture(scope="module")
def token_case() -> tuple[nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    return TokenModel().double(), _token_inputs(5, 1), _token_inputs(3, 2)


def _logits_at_0(out: dict[str, torch.Tensor]) -> torch.Tensor:  # the reference's own selection, by hand
    return out["logits"][:, 0]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=str)
@pytest.mark.parametrize("mode", [*KernelMode, "pseudo"], ids=str)
def test_mapping_inputs_match_reference(token_case: tuple, implementation: NtkImplementation, mode: str) -> None:
    model, x1, x2 = token_case
    for side2 in (x2, None):
        result = compute_ntk(
            model, x1, side2, mode=mode, output="logits[:, 0]", implementation=implementation, dtype=torch.float64
        )
        expected = reference_ntk(model, x1, side2, str(mode), output=_logits_at_0)
        assert_matches(result.theta, expected, 1e-10)
        if implementation is not NtkImplementation.AUTO:
            assert result.implementation is implementation


def test_mapping_inputs_with_a_parameter_subset(token_case: tuple) -> None:
    model, x1, x2 = token_case
    for implementation in IMPLEMENTATIONS:
        result = compute_ntk(
            model, x1, x2, params=["lin.*"], output="logits", implementation=implementation, dtype=torch.float64
        )
        expected = reference_ntk(model, x1, x2, params=["lin.*"], output=lambda out: out["logits"])
        assert_matches(result.theta, expected, 1e-10)
        assert result.theta.shape == (5, 3, 18, 18)  # k = 6 positions x 3 logits


def test_x2_names_in_another_order(token_case: tuple) -> None:
    model, x1, x2 = token_case
    reordered = {name: x2[name] for name in reversed(list(x2))}
    result = compute_ntk(model, x1, reordered, output="logits[:, 0]", dtype=torch.float64)
    assert_matches(result.theta, reference_ntk(model, x1, x2, output=_logits_at_0), 1e-10)


class TwoInputs(nn.Module):
    """Positional inputs: a float image-like tensor and a float side vector."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x).mean(1) + z))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=str)
def test_tuple_inputs_match_reference(implementation: NtkImplementation) -> None:
    torch.manual_seed(1)
    model = TwoInputs().double()
    x1 = (torch.randn(4, 2, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64))
    x2 = (torch.randn(3, 2, 4, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64))
    for mode in ("full", "trace"):
        result = compute_ntk(model, x1, x2, mode=mode, implementation=implementation, dtype=torch.float64)
        assert_matches(result.theta, reference_ntk(model, x1, x2, mode), 1e-10)


@dataclass
class _Output:
    logits: torch.Tensor
    extra: tuple[torch.Tensor, ...]


class AttributeOutput(nn.Module):
    """Returns an object with attributes, like a ``ModelOutput`` read by attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> _Output:
        y = self.lin(x)
        return _Output(logits=y, extra=(y.tanh(), y * 2))


def test_attribute_and_tuple_paths_match_reference() -> None:
    torch.manual_seed(2)
    model, x = AttributeOutput().double(), torch.randn(4, 3, dtype=torch.float64)
    result = compute_ntk(model, x, output="logits[:, 1:3]", dtype=torch.float64)
    assert_matches(result.theta, reference_ntk(model, x, output=lambda out: out.logits[:, 1:3]), 1e-10)
    result = compute_ntk(model, x, output="extra[0]", dtype=torch.float64)
    assert_matches(result.theta, reference_ntk(model, x, output=lambda out: out.extra[0]), 1e-10)


# ---- bad input: each an InvalidInput naming the leaf


def test_leaves_with_different_n(token_case: tuple) -> None:
    model, x1, _ = token_case
    bad = {**x1, "extra": x1["extra"][:3]}
    with pytest.raises(ShapeMismatch, match=r"x1\['input_ids'\]: 5.*x1\['extra'\]: 3"):
        compute_ntk(model, bad, output="logits")


def test_missing_and_extra_names(token_case: tuple) -> None:
    model, x1, x2 = token_case
    with pytest.raises(InvalidInput, match=r"missing \['attention_mask'\], extra \['mask'\]"):
        compute_ntk(model, x1, {**{k: v for k, v in x2.items() if k != "attention_mask"}, "mask": x2["extra"]})
    with pytest.raises(InvalidInput, match="x1 is a dict but x2 is a Tensor"):
        compute_ntk(model, x1, x2["extra"], output="logits")


def test_model_missing_an_input_names_the_inputs(token_case: tuple) -> None:
    model, x1, _ = token_case
    with pytest.raises(InvalidInput, match=r"does not take the inputs \['input_ids'\]: \(6,\).*missing .*'extra'"):
        compute_ntk(model, {k: v for k, v in x1.items() if k != "extra"}, output="logits")


def test_float_where_ids_go(token_case: tuple) -> None:
    model, x1, _ = token_case
    with pytest.raises(InvalidInput, match=r"\['input_ids'\] is torch.float64 but it feeds the nn.Embedding 'emb'"):
        compute_ntk(model, {**x1, "input_ids": x1["input_ids"].double()}, output="logits")


@pytest.mark.parametrize("side", ["x1", "x2"])
def test_ids_beyond_the_vocabulary_in_any_example(token_case: tuple, side: str) -> None:
    model, x1, x2 = token_case
    x1, x2 = _token_inputs(7, 3), _token_inputs(6, 4)  # the probe sees the first 4 examples of x1 only
    bad = dict(x1 if side == "x1" else x2)
    bad["input_ids"] = bad["input_ids"].clone()
    bad["input_ids"][5, 2] = VOCAB + 3
    pair = (bad, x2) if side == "x1" else (x1, bad)
    message = rf"{side}\['input_ids'\] has token id {VOCAB + 3} in example 5, outside the vocabulary of nn.Embedding"
    for _ in range(2):  # the second call takes the kept problem: checked again
        with pytest.raises(InvalidInput, match=message):
            compute_ntk(model, *pair, output="logits")
        compute_ntk(model, x1, x2, output="logits")  # and a good call keeps the problem


def test_negative_id_in_the_probe(token_case: tuple) -> None:
    model, x1, _ = token_case
    bad = {**x1, "input_ids": x1["input_ids"].clone()}
    bad["input_ids"][1, 0] = -1
    with pytest.raises(InvalidInput, match=r"x1\['input_ids'\] has token id -1 in example 1"):
        compute_ntk(model, bad, output="logits")


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("scores", r"'scores' is not in the dict there \(keys: 'logits', 'hidden'\)"),
        ("logits.value", r"'value' is not in the Tensor there"),
        ("logits[0]", r"first index of a tensor must be ':'"),
        ("logits[:, 9]", r"index \[:, 9\] does not fit the tensor of shape \(4, 6, 3\)"),
        ("logits[", r"a '\[' is not closed"),
        ("__import__('os')", r"unexpected character"),
    ],
)
def test_output_paths_that_do_not_exist(token_case: tuple, path: str, message: str) -> None:
    model, x1, _ = token_case
    with pytest.raises(InvalidInput, match=message):
        compute_ntk(model, x1, output=path)


def test_dict_output_without_a_path(token_case: tuple) -> None:
    model, x1, _ = token_case
    with pytest.raises(InvalidInput, match=r"returned a dict \(keys: 'logits', 'hidden'\), not a tensor"):
        compute_ntk(model, x1)


def test_output_path_grammar() -> None:
    path = parse_output("a.b[..., 1:3][0]")
    assert path is not None and path.steps == ("a", "b", (Ellipsis, slice(1, 3)), (0,))
    out = select_output({"a": {"b": (torch.arange(24).reshape(2, 3, 4),)}}, parse_output("a.b[0][:, -1, ::2]"))
    assert torch.equal(out, torch.arange(24).reshape(2, 3, 4)[:, -1, ::2])
    for bad in ["", "a.", "a[]", "a b", "1a", "a[::1:]", "a+b", "a[1.5]"]:
        with pytest.raises(InvalidInput, match="output path"):
            parse_output(bad)


class BranchesOnValues(nn.Module):
    """A forward that branches on the mask's values, as BERT's ``padding_mask.all()``: vmap refuses it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 4)
        self.lin = nn.Linear(4, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        if not attention_mask.all():
            h = h * attention_mask.unsqueeze(-1)
        return self.lin(torch.tanh(h)).mean(1)


def test_data_dependent_control_flow_takes_the_per_example_loop() -> None:
    torch.manual_seed(3)
    model = BranchesOnValues().double()
    x1, x2 = _token_inputs(4, 5), _token_inputs(3, 6)
    del x1["extra"], x2["extra"]
    for implementation in ("auto", "jacobian_contraction"):
        result = compute_ntk(model, x1, x2, implementation=implementation, dtype=torch.float64)
        assert result.implementation is NtkImplementation.JACOBIAN_CONTRACTION
        assert result.per_example_loop
        assert_matches(result.theta, reference_ntk(model, x1, x2), 1e-10)
    for implementation in ("ntk_vector_products", "structured"):
        with pytest.raises(UnsupportedModel, match="data-dependent control flow.*jacobian_contraction"):
            compute_ntk(model, x1, x2, implementation=implementation, dtype=torch.float64)


# ---- the rest of the library takes the same inputs and output=


def test_groups_with_mapping_inputs(token_case: tuple) -> None:
    model, x1, x2 = token_case
    for implementation in ("jacobian_contraction", "structured", "auto"):
        result = compute_ntk_groups(
            model, x1, x2, groups="modules", output="logits[:, 0]", implementation=implementation, dtype=torch.float64
        )
        assert set(result.thetas) == {"emb", "lin", "side"}
        for name, theta in result.thetas.items():
            assert_matches(theta, reference_ntk(model, x1, x2, params=[f"{name}.*"], output=_logits_at_0), 1e-10)


@pytest.mark.parametrize("mode", ["full", "trace"])
def test_nngp_with_mapping_inputs(token_case: tuple, mode: str) -> None:
    model, x1, x2 = token_case
    result = compute_nngp(model, x1, x2, output="logits[:, 0]", mode=mode, dtype=torch.float64)
    with torch.no_grad():  # the outputs' outer products, by hand
        f1, f2 = (model(**x)["logits"][:, 0].double() for x in (x1, x2))
    full = torch.einsum("na,mb->nmab", f1, f2)
    expected = full if mode == "full" else full.diagonal(dim1=2, dim2=3).sum(-1)
    assert_matches(result.theta, expected, 1e-12)


def test_monte_carlo_with_mapping_inputs(token_case: tuple) -> None:
    _, x1, x2 = token_case

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return TokenModel().double()

    result = monte_carlo_ntk(build, x1, x2, seeds=[3, 4], output="logits[:, 0]", mode="trace", dtype=torch.float64)
    expected = sum(reference_ntk(build(s), x1, x2, "trace", output=_logits_at_0) for s in (3, 4)) / 2
    assert_matches(result.mean, expected, 1e-10)


def test_operator_with_mapping_inputs(token_case: tuple) -> None:
    model, x1, x2 = token_case
    op = ntk_operator(model, x1, x2, output="logits[:, 0]", dtype=torch.float64)
    full = reference_ntk(model, x1, x2, output=_logits_at_0)  # (N, M, k, k)
    dense = full.permute(0, 2, 1, 3).reshape(5 * 3, 3 * 3)
    v = torch.randn(3, 3, dtype=torch.float64)
    assert_matches(op.matvec(v), (dense @ v.reshape(-1)).reshape(5, 3), 1e-10)


def test_monte_carlo_of_a_model_that_branches_on_values() -> None:
    x1 = _token_inputs(3, 7)
    del x1["extra"]

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return BranchesOnValues().double()

    result = monte_carlo_ntk(build, x1, seeds=[1, 2], mode="trace", dtype=torch.float64)
    expected = sum(reference_ntk(build(s), x1, mode="trace") for s in (1, 2)) / 2
    assert_matches(result.mean, expected, 1e-10)
