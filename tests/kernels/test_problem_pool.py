"""Prepared problems kept across calls (NOTE [problem pool]): reused while the model is the same, never stale."""

from __future__ import annotations

import copy
import subprocess
import sys
import types
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from ntk_service.kernels import choice, compute_ntk
from ntk_service.kernels.choice import ALGORITHMS
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.planning import plan_blocks
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.runtime import problem_pool
from ntk_service.kernels.types import NtkImplementation
from tests.reference import assert_matches, reference_ntk


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[NtkProblem]]:
    """Every problem ``prepared_problem`` builds (a spy around the real ``build_problem``)."""
    built: list[NtkProblem] = []
    real = problem_pool.build_problem

    def spy(*args: object, **kwargs: object) -> NtkProblem:
        problem = real(*args, **kwargs)  # type: ignore[arg-type]
        built.append(problem)
        return problem

    monkeypatch.setattr(problem_pool, "build_problem", spy)
    problem_pool.clear()
    yield built
    problem_pool.clear()


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.LeakyReLU(0.1), nn.Linear(5, 2)).double()


def _check(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor) -> None:
    theta = compute_ntk(model, x1, x2, implementation="structured").theta
    expected = reference_ntk(model, x1, x2, "full")
    assert_matches(theta, expected)


def test_repeated_calls_reuse_one_problem(builds: list[NtkProblem]) -> None:
    model, x = _mlp(), torch.randn(4, 3, dtype=torch.float64)
    for _ in range(3):
        compute_ntk(model, x, x + 1)
    assert len(builds) == 1
    compute_ntk(model, x[:, :2].repeat(1, 2)[:, :3])  # same signature (shape, dtype, params): still one
    assert len(builds) == 1
    compute_ntk(model, x, params=["0.*"])  # another parameter selection is another problem
    assert len(builds) == 2


def _sgd_step(model: nn.Module) -> None:
    model(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()


MUTATIONS: dict[str, Callable[[nn.Module], None]] = {
    "optimizer step (in place)": _sgd_step,
    "load_state_dict": lambda m: m.load_state_dict({k: v + 0.3 for k, v in m.state_dict().items()}),
    "replaced submodule": lambda m: m.__setitem__(1, nn.Tanh()),
    "changed hyper-parameter": lambda m: setattr(m[1], "negative_slope", 0.7),
    "p.data reassigned": lambda m: setattr(m[0].weight, "data", torch.randn(5, 3, dtype=torch.float64)),
    "new Parameter": lambda m: setattr(m[2], "bias", nn.Parameter(torch.randn(2, dtype=torch.float64))),
}


@pytest.mark.parametrize("mutate", MUTATIONS.values(), ids=MUTATIONS.keys())
def test_a_changed_model_is_never_computed_from_a_stale_problem(
    builds: list[NtkProblem], mutate: Callable[[nn.Module], None]
) -> None:
    model = _mlp()
    x1, x2 = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    _check(model, x1, x2)
    mutate(model)
    _check(model, x1, x2)


class _Configured(nn.Module):
    """A model reading a flag of a config object it holds (the private copy holds a copy of the object)."""

    def __init__(self) -> None:
        super().__init__()
        self.cfg = types.SimpleNamespace(scale=1.0)
        self.first, self.head = nn.Linear(3, 5), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.first(x)) * self.cfg.scale)


@pytest.mark.parametrize("implementation", ["structured", "jacobian_contraction"])
def test_a_changed_config_object_is_a_changed_model(builds: list[NtkProblem], implementation: str) -> None:
    torch.manual_seed(0)
    model = _Configured().double()
    x1, x2 = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    for scale in (1.0, 2.0):
        model.cfg.scale = scale
        theta = compute_ntk(model, x1, x2, implementation=implementation).theta
        assert_matches(theta, reference_ntk(model, x1, x2))
    assert len(builds) == 2


def test_dtype_converting_calls_are_not_kept(builds: list[NtkProblem]) -> None:
    model, x = _mlp().float(), torch.randn(4, 3)
    compute_ntk(model, x, dtype=torch.float64)
    compute_ntk(model, x, dtype=torch.float64)
    assert len(builds) == 2  # a kept float64 copy of the weights would go stale on in-place updates
    with torch.no_grad():
        model[0].weight.mul_(2)
    theta = compute_ntk(model, x, dtype=torch.float64).theta
    torch.testing.assert_close(theta, reference_ntk(model, x, None, "full"), rtol=1e-6, atol=1e-6)


def test_failed_calls_do_not_keep_their_problem(builds: list[NtkProblem]) -> None:
    model, x = _mlp(), torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(Exception, match="memory budget"):
        compute_ntk(model, x, memory_budget_bytes=10)
    compute_ntk(model, x)
    assert len(builds) == 2


def test_one_block_kernels_build_both_sides_in_one_pass() -> None:
    model, x1, x2 = _mlp(), torch.randn(6, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    result = compute_ntk(model, x1, x2, implementation="structured")
    with problem_pool.prepared_problem(model, x1, x2, params=None, dtype=None) as prepared:
        problem = prepared.problem
        alg = ALGORITHMS[NtkImplementation.STRUCTURED]
        plan = plan_blocks(alg, problem, 6, 5, KernelMode.FULL, symmetric=False, budget_bytes=2**30)
        tight = plan_blocks(alg, problem, 6, 5, KernelMode.FULL, symmetric=False, budget_bytes=plan.estimate_bytes - 1)
    assert plan.joint_sides and (plan.block_n, plan.block_m) == (6, 5)
    assert not tight.joint_sides  # a budget the joint pass would exceed gets separate sides
    expected = reference_ntk(model, x1, x2, "full")
    assert_matches(result.theta, expected)


class _TokenPool(nn.Module):
    """A Linear over t tokens, mean-pooled, then a head: the first Linear is a factored term of t tokens (wide
    enough that the plan factors it rather than building its Jacobian)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(64, 64), nn.Linear(64, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x)).mean(-2))


def test_the_per_example_blocks_estimate_counts_their_gram() -> None:
    """The structured per-example blocks build a (n·g, k·t, k·t) Gram of the output cotangents per factored term
    (``add_factored_diagonal``), beside the (n, g, t, t) Gram of the inputs: the block's estimate covers both,
    counted here by hand for a Linear over t = 7 tokens (g = 1), k = 5 outputs, n = 4 examples."""
    n, t, k = 4, 7, 5
    x = torch.randn(n, t, 64, dtype=torch.float64)
    with problem_pool.prepared_problem(_TokenPool(k).double(), x, None, params=None, dtype=None) as prepared:
        problem = prepared.problem
        alg = ALGORITHMS[NtkImplementation.STRUCTURED]
        dims = [term.dims[:2] for term in alg.terms(problem).factored]
        estimate = alg.pair_bytes(problem, n, 1, KernelMode.EXAMPLE_DIAGONAL)
    assert problem.k == k and (1, t) in dims  # the embedding's term: g = 1 group of t tokens
    assert estimate >= n * t * t * (1 + k * k) * 8  # the inputs' Gram and the k² cotangent Gram, float64


def test_kept_choices_are_the_plans_a_fresh_problem_would_make(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [auto choice]: a kept problem reuses its plan for a call shape only while the budget gives the same
    answer; every call's plan equals the one a never-seen model (a fresh problem) gets, and repeats plan nothing."""
    planned: list[int] = []
    real = choice.plan_blocks

    def spy(*args: object, **kwargs: object) -> object:
        planned.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(choice, "plan_blocks", spy)
    model, x1, x2 = _mlp(), torch.randn(16, 3, dtype=torch.float64), torch.randn(12, 3, dtype=torch.float64)
    with problem_pool.prepared_problem(copy.deepcopy(model), x1, x2, params=None, dtype=None) as prepared:
        alg = ALGORITHMS[NtkImplementation.STRUCTURED]
        joint = plan_blocks(alg, prepared.problem, 16, 12, KernelMode.FULL, symmetric=False, budget_bytes=2**30)
        tight = plan_blocks(
            alg, prepared.problem, 16, 12, KernelMode.FULL, symmetric=False, budget_bytes=joint.estimate_bytes - 1
        )
    assert joint.joint_sides and not tight.joint_sides
    # (budget, whether the structured choice kept from the call before must be re-planned): the first call; a
    # larger budget (the joint plan is the first choice: kept); one the joint pass exceeds; one between that plan's
    # estimate and its budget (kept); a larger one (it was not the first choice: re-planned); the same (kept)
    steps = [(2**30, True), (2**31, False), (joint.estimate_bytes - 1, True), (tight.estimate_bytes, False)]
    steps += [(2**30, True), (2**30, False)]
    for implementation in ("structured", "auto"):
        for budget, expect_planning in steps:
            planned.clear()
            kept = compute_ntk(model, x1, x2, implementation=implementation, memory_budget_bytes=budget)
            if implementation == "structured":  # AUTO's reuse also depends on the costs of the others
                assert bool(planned) is expect_planning
            fresh = compute_ntk(copy.deepcopy(model), x1, x2, implementation=implementation, memory_budget_bytes=budget)
            assert (kept.implementation, kept.block_size, kept.estimate_bytes) == (
                fresh.implementation,
                fresh.block_size,
                fresh.estimate_bytes,
            )
            torch.testing.assert_close(kept.theta, fresh.theta, rtol=1e-12, atol=0.0)


_FAULTS = """
import resource, sys, torch
if sys.argv[1] == "retain":
    from ntk_service.kernels.runtime.allocator import retain_freed_memory
    assert retain_freed_memory()
for _ in range(3):
    torch.ones(1024, 1024)  # 4 MiB, allocated, touched and freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.ones(1024, 1024)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_retained_memory_spares_the_page_faults_of_fresh_buffers() -> None:
    def faults(how: str) -> int:
        out = subprocess.run([sys.executable, "-c", _FAULTS, how], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    default, retained = faults("default"), faults("retain")
    assert default > 2000, "the default allocator reused its pages: this test cannot tell the difference"
    assert retained * 10 < default, f"{retained} page faults with retained memory vs {default} by default"
