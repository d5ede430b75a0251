"""compute_ntk against the independent float64 reference, for every implementation, mode and model of the zoo."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

from ntk_service.errors import UnsupportedModel
from ntk_service.kernels import KernelMode, NtkImplementation, compute_ntk
from ntk_service.kernels.choice import ALGORITHMS
from ntk_service.kernels.problem.private_module import private_copy
from tests.kernels.zoo import ZOO, ZooEntry, zoo_case
from tests.reference import assert_matches, reference_ntk

IMPLEMENTATIONS = [*ALGORITHMS, NtkImplementation.AUTO]
MODES = list(KernelMode)


@functools.cache
def _reference(name: str, mode: KernelMode, with_x2: bool, subset: bool) -> torch.Tensor:
    model, x1, x2 = zoo_case(name)
    entry = next(e for e in ZOO if e.name == name)
    return reference_ntk(model, x1, x2 if with_x2 else None, mode.value, entry.subset if subset else None)


@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=str)
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_float64_matches_reference(entry: ZooEntry, implementation: NtkImplementation, mode: KernelMode) -> None:
    model, x1, x2 = zoo_case(entry.name)
    for with_x2 in (True, False):
        for subset in (False, True):
            result = compute_ntk(
                model,
                x1,
                x2 if with_x2 else None,
                mode=mode,
                implementation=implementation,
                params=entry.subset if subset else None,
                dtype=torch.float64,
            )
            assert result.theta.dtype == torch.float64
            assert result.implementation is not NtkImplementation.AUTO
            if implementation is not NtkImplementation.AUTO:
                assert result.implementation is implementation
            assert_matches(result.theta, _reference(entry.name, mode, with_x2, subset), 1e-10)


@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=str)
def test_float32_matches_reference(entry: ZooEntry, implementation: NtkImplementation) -> None:
    model, x1, x2 = zoo_case(entry.name)
    result = compute_ntk(model, x1, x2, mode="full", implementation=implementation)
    assert result.theta.dtype == torch.float32
    assert_matches(result.theta, _reference(entry.name, KernelMode.FULL, True, False), 1e-4)


@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_same_inputs_give_exactly_symmetric_psd_kernel(entry: ZooEntry) -> None:
    model, x1, _ = zoo_case(entry.name)
    for implementation in ALGORITHMS:
        theta = compute_ntk(model, x1, implementation=implementation, dtype=torch.float64).theta
        n, _, k, _ = theta.shape
        gram = theta.permute(0, 2, 1, 3).reshape(n * k, n * k)
        assert torch.equal(gram, gram.T)
        assert torch.linalg.eigvalsh(gram).min().item() >= -1e-10 * gram.abs().max().item()
        trace = compute_ntk(model, x1, mode="trace", implementation=implementation, dtype=torch.float64).theta
        assert torch.equal(trace, trace.T)


@pytest.mark.parametrize("implementation", list(ALGORITHMS), ids=str)
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_blocked_computation_matches_reference(implementation: NtkImplementation, mode: KernelMode) -> None:
    """Budgets that force blocks give the same kernel (ragged blocks, kept right sides, mirrored halves)."""
    torch.manual_seed(0)
    # k = 1 and a wide hidden layer: sides dominate the result, so some plans keep every right side.
    model = nn.Sequential(nn.Linear(4, 60), nn.Tanh(), nn.Linear(60, 1))
    x1, x2 = torch.randn(7, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    same_size = torch.randn(7, 4, dtype=torch.float64)  # x2's blocks cover the same ranges as x1's
    for second in (x2, same_size, None):
        expected = reference_ntk(model, x1, second, mode.value)
        whole = compute_ntk(model, x1, second, mode=mode, implementation=implementation, dtype=torch.float64)
        for budget in (whole.estimate_bytes - 1, whole.estimate_bytes // 2):
            blocked = compute_ntk(
                model,
                x1,
                second,
                mode=mode,
                implementation=implementation,
                dtype=torch.float64,
                memory_budget_bytes=budget,
            )
            assert blocked.block_size < x1.shape[0]
            assert blocked.estimate_bytes <= budget
            assert_matches(blocked.theta, expected, 1e-10)
            if second is None and mode.spec.pairs:
                swapped = blocked.theta.transpose(0, 1)
                assert torch.equal(blocked.theta, swapped.transpose(2, 3) if mode is KernelMode.FULL else swapped)


def _weight_norm_models() -> tuple[nn.Module, nn.Module]:
    """The same model with the deprecated ``torch.nn.utils.weight_norm`` (a forward pre-hook sets ``weight``; the
    module cannot be deep-copied) and with the parametrization API, which the reference can copy."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # weight_norm is deprecated: the point of the test
        hooked = nn.Sequential(nn.utils.weight_norm(nn.Linear(4, 6)), nn.Tanh(), nn.Linear(6, 3)).double()
    parametrized = nn.Sequential(
        nn.utils.parametrizations.weight_norm(nn.Linear(4, 6)), nn.Tanh(), nn.Linear(6, 3)
    ).double()
    with torch.no_grad():
        parametrized[0].parametrizations.weight.original0.copy_(hooked[0].weight_g)
        parametrized[0].parametrizations.weight.original1.copy_(hooked[0].weight_v)
        parametrized[0].bias.copy_(hooked[0].bias)
        parametrized[2].load_state_dict(hooked[2].state_dict())
    return hooked, parametrized


_NO_BATCHING_RULE = "ignore:There is a performance drop:UserWarning"
"""functorch's note that weight_norm's backward kernels have no vmap rule (it loops instead): beside the point."""


@pytest.mark.filterwarnings(_NO_BATCHING_RULE)
@pytest.mark.parametrize("implementation", ["structured", "jacobian_contraction", "auto"])
def test_a_module_that_cannot_be_copied_is_computed_in_place_and_left_as_it_was(implementation: str) -> None:
    """NOTE [private module]: such a module is used itself, under a lock; its plain tensor attributes come back as
    they were (weight_norm's hook would leave a functorch wrapper in ``weight``, and the next call would fail)."""
    hooked, parametrized = _weight_norm_models()
    assert private_copy(hooked) is None  # the case under test
    x1, x2 = torch.randn(5, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    weight = hooked[0].weight
    for _ in range(2):  # the second call goes through the problem pool's fingerprint of the module
        for mode in MODES:
            theta = compute_ntk(hooked, x1, x2, mode=mode, implementation=implementation).theta
            assert_matches(theta, reference_ntk(parametrized, x1, x2, mode.value), 1e-10)
            assert hooked[0].weight is weight


@pytest.mark.filterwarnings(_NO_BATCHING_RULE)
def test_forward_mode_ad_missing_for_an_operation_is_the_models_limit() -> None:
    hooked, _ = _weight_norm_models()
    with pytest.raises(UnsupportedModel, match="without forward-mode AD.*use implementation="):
        compute_ntk(hooked, torch.randn(3, 4, dtype=torch.float64), implementation="ntk_vector_products")
