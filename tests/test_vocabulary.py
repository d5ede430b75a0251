"""``ntk_service.vocabulary``: the table of modes agrees with its Literal types, with the engine's results and with
the float64 reference, and importing it (or the client) loads no torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import get_args

import pytest
import torch
from torch import nn

from ntk_service import vocabulary
from ntk_service.analysis.solve.table import ALIASES, SOLVERS
from ntk_service.errors import UnknownImplementation, UnknownMode
from ntk_service.kernels import compute_ntk
from ntk_service.vocabulary import MODES, DerivedMode, KernelMode, NtkImplementation
from tests.conftest import REPO_ROOT
from tests.reference import reference_ntk


def test_the_literal_types_name_the_rows_of_the_table() -> None:
    assert get_args(vocabulary.ModeName) == vocabulary.MODE_NAMES == tuple(MODES)
    assert get_args(vocabulary.ContractedModeName) == tuple(m.value for m in vocabulary.CONTRACTED_MODES)
    assert get_args(vocabulary.OperatorModeName) == tuple(m.value for m in vocabulary.OPERATOR_MODES)
    assert get_args(vocabulary.ImplementationName) == tuple(i.value for i in NtkImplementation)
    assert set(get_args(vocabulary.SolverName)) == set(SOLVERS) | set(ALIASES)
    assert {*KernelMode, *DerivedMode} == {spec.mode for spec in MODES.values()}
    assert all(spec.derived == isinstance(spec.mode, DerivedMode) for spec in MODES.values())
    assert all(spec.mode.spec is spec for spec in MODES.values())


def test_shapes_and_dimension_names_follow_the_axes() -> None:
    assert MODES["full"].result_shape(5, 4, 3) == (5, 4, 3, 3)
    assert MODES["trace"].result_shape(5, 4, 3) == (5, 4)
    assert MODES["example_diagonal"].result_shape(5, 4, 3) == (5, 3, 3)
    assert MODES["output_diagonal"].result_shape(5, 4, 3) == (5, 4, 3)
    assert MODES["pseudo"].result_shape(5, 4, 3) == (5, 4)
    for spec in MODES.values():
        assert len(spec.dimension_names) == len(spec.shape)
        assert spec.contraction in vocabulary.CONTRACTED_MODES
    assert vocabulary.mode_help(("full", "trace")) == "full (N, M, k, k) | trace (N, M)"


def test_a_modes_contraction_follows_from_its_axes() -> None:
    """NOTE [mode contractions]: a mode of example pairs is contracted as itself, a per-example one as the blocks of
    all outputs of each example (then reduced), a derived one as its base; the implementations read the axes."""
    examples, outputs = vocabulary.Examples, vocabulary.Outputs
    for spec in MODES.values():
        core = spec.contraction.spec
        if spec.derived:
            assert core.mode is spec.base and core.axes == spec.axes
        elif spec.pairs:
            assert core is spec
        else:
            assert core.axes == (examples.SAME, outputs.ALL)
    # written out for k = 3: entries per example (pair), and the output pairs (a, b) their contraction takes
    assert [outputs.ALL.entries(3), outputs.DIAGONAL.entries(3), outputs.SUM.entries(3)] == [9, 3, 1]
    assert [outputs.ALL.products(3), outputs.DIAGONAL.products(3), outputs.SUM.products(3)] == [9, 3, 3]


@pytest.fixture(scope="module")
def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()


@pytest.mark.parametrize("name", vocabulary.MODE_NAMES)
def test_each_row_describes_the_engines_result_and_the_reference(mlp: nn.Module, name: str) -> None:
    """The row's shape is the engine's; its ``example_swap`` takes the reference Θ(x1, x2) to Θ(x2, x1)."""
    x1, x2 = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    spec = MODES[name]
    result = compute_ntk(mlp, x1, x2, mode=name)
    assert result.mode is spec.mode
    assert tuple(result.theta.shape) == spec.result_shape(4, 3, 2)
    expected = reference_ntk(mlp, x1, x2, name)
    torch.testing.assert_close(result.theta, expected, rtol=1e-10, atol=1e-12)
    if spec.pairs:
        swapped = reference_ntk(mlp, x2, x1, name)
        torch.testing.assert_close(expected.permute(*spec.example_swap), swapped, rtol=1e-12, atol=1e-14)


def test_parsers_name_the_valid_values() -> None:
    assert vocabulary.parse_any_mode("pseudo") is DerivedMode.PSEUDO
    assert vocabulary.parse_mode(KernelMode.TRACE) is KernelMode.TRACE
    with pytest.raises(UnknownMode, match="compute_ntk: unknown mode 'pseudo'; expected one of 'full', 'trace'"):
        vocabulary.parse_mode("pseudo")
    with pytest.raises(UnknownMode, match="op: unknown mode 'diagonal'; expected one of .*'pseudo'"):
        vocabulary.parse_any_mode("diagonal", operation="op")
    with pytest.raises(UnknownMode, match="unknown mode 3"):
        vocabulary.parse_any_mode(3)  # type: ignore[arg-type]
    with pytest.raises(UnknownImplementation, match="expected one of 'auto', 'jacobian_contraction'"):
        vocabulary.parse_implementation("fast")


def test_old_homes_name_the_same_objects() -> None:
    from ntk_service.kernels import modes, types

    assert modes.KernelMode is KernelMode and modes.DerivedMode is DerivedMode
    assert modes.parse_any_mode is vocabulary.parse_any_mode and modes.result_shape is vocabulary.result_shape
    assert types.NtkImplementation is NtkImplementation
    assert types.parse_implementation is vocabulary.parse_implementation


def test_the_vocabulary_and_the_client_import_without_torch() -> None:
    """The client and the CLI share these words without paying for torch (or numpy, for the vocabulary)."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules.update(torch=None)  # `import torch` raises ImportError, as where torch is not installed
        import ntk_service.vocabulary
        assert "numpy" not in sys.modules, "the vocabulary loads numpy"
        import ntk_service.client
        from ntk_service.client import KernelModeName
        print(KernelModeName is ntk_service.vocabulary.ModeName)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
