"""The solvers of the table (dense, pcg, block, auto) against scipy's Cholesky on the float64 kernel of
tests/reference.py (an independent per-example autograd loop): each method's guarantee, a true relative residual
≤ rtol, recomputed here with the reference kernel, and an error within cond × rtol of the Cholesky solution;
auto's choices and fallbacks; resuming, progress, the held-out curve; bad input naming its field."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np
import pytest
import scipy.linalg
import scipy.sparse
import scipy.sparse.linalg
import torch
from torch import nn

from ntk_service.analysis import gp_inference
from ntk_service.analysis.solve import (
    DENSE_MAX_ROWS,
    SOLVERS,
    AutoSolver,
    HeldOut,
    InverseOperator,
    Progress,
    SolverOptions,
    SolverResult,
    auto_order,
    make_problem,
    solve_kernel,
)
from ntk_service.errors import InvalidInput, MemoryEstimateExceeded, ShapeMismatch
from ntk_service.kernels import ntk_operator
from tests.reference import reference_ntk

K = 3
RTOL = 1e-8
"""The tests' rtol: 10⁵ × above float64 rounding of these kernels (cond ≤ 3·10³, eps·cond ≈ 1e-13)."""

BLOCK = {"block_size": 60, "landmarks": 16, "inner_steps": 4}
"""The block method's settings for the tests' 120 examples: two blocks an epoch."""


@dataclass(frozen=True)
class Problem:
    model: nn.Module
    x: torch.Tensor
    x_test: torch.Tensor
    y: np.ndarray
    matrix: np.ndarray  # reference FULL kernel, example-major (N·k, N·k)
    cross: np.ndarray  # reference Θ(x_test, x) (M·k, N·k)
    ridge: float

    def cholesky(self, ridge: float | None = None) -> np.ndarray:
        lam = self.ridge if ridge is None else ridge
        factor = scipy.linalg.cho_factor(self.matrix + lam * np.eye(self.matrix.shape[0]))
        return np.asarray(scipy.linalg.cho_solve(factor, self.y.reshape(-1)))

    def residual(self, alpha: np.ndarray, ridge: float | None = None) -> float:
        lam = self.ridge if ridge is None else ridge
        b = self.y.reshape(-1)
        a = alpha.reshape(-1)
        return float(np.linalg.norm(b - self.matrix @ a - lam * a) / np.linalg.norm(b))

    def cond(self, ridge: float | None = None) -> float:
        lam = self.ridge if ridge is None else ridge
        values = np.linalg.eigvalsh(self.matrix)
        return float((values[-1] + lam) / (max(values[0], 0.0) + lam))


def _example_major(theta: torch.Tensor) -> np.ndarray:
    n, m, k, _ = theta.shape
    return theta.permute(0, 2, 1, 3).reshape(n * k, m * k).numpy()


def _problem(d: int, width: int, n: int, relative_ridge: float) -> Problem:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, K))
    model = model.double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    x_test = torch.randn(8, d, generator=g, dtype=torch.float64)
    y = np.random.default_rng(2).standard_normal((n, K))
    matrix = _example_major(reference_ntk(model, x))
    cross = _example_major(reference_ntk(model, x_test, x))
    return Problem(model, x, x_test, y, matrix, cross, relative_ridge * float(np.mean(np.diag(matrix))))


@pytest.fixture(scope="module")
def wide() -> Problem:
    """P = 12,611 parameters ≫ n = 360 rows (the regime of the block method), ridge 1e-2 × mean diagonal."""
    return _problem(128, 64, 120, 1e-2)


def _check_guarantee(problem: Problem, result: SolverResult, rtol: float = RTOL) -> None:
    assert result.converged, result.stop_reason
    assert problem.residual(result.solution) <= 2 * rtol  # the true residual, recomputed with the reference
    expected = problem.cholesky()
    error = np.linalg.norm(result.solution.reshape(-1) - expected) / np.linalg.norm(expected)
    assert error <= 2 * problem.cond() * rtol


@pytest.mark.parametrize("solver", ["dense", "pcg", "block", "auto"])
def test_every_solver_meets_its_guarantee(wide: Problem, solver: str) -> None:
    settings = BLOCK if solver == "block" else {}
    options = SolverOptions(solver=solver, rtol=RTOL, **settings)  # type: ignore[arg-type]
    result = solve_kernel(ntk_operator(wide.model, wide.x), wide.y, ridge=wide.ridge, options=options)
    _check_guarantee(wide, result)
    assert result.solver == ("dense" if solver == "auto" else solver)  # auto: 360 rows ≤ DENSE_MAX_ROWS
    assert result.solution.shape == (3 * 120, 1) and result.time_s > 0 and result.memory_bytes > 0
    if solver == "block":
        assert result.weights is not None and result.epochs >= 1 and result.passes > 0
        # w = Jᵀα: J(x_test) w are the test predictions Θ(x_test, x) α
        predictions = ntk_operator(wide.model, wide.x_test, wide.x).jvp(result.weights)
        np.testing.assert_allclose(predictions.reshape(-1), wide.cross @ result.solution[:, 0], rtol=0, atol=1e-9)


def test_auto_solves_a_small_ill_conditioned_float64_problem_densely() -> None:
    """The issue's case: a few hundred examples, k = 3, ridge 1e-6 × mean diagonal, where CG stopped at 2000
    iterations: auto is the dense Cholesky, equal to scipy's to 1e-6."""
    problem = _problem(8, 32, 100, 1e-6)
    result = solve_kernel(ntk_operator(problem.model, problem.x), problem.y, ridge=problem.ridge)
    assert result.converged and result.solver == "dense" and [a.solver for a in result.attempts] == ["dense"]
    expected = problem.cholesky()
    assert np.linalg.norm(result.solution[:, 0] - expected) / np.linalg.norm(expected) <= 1e-6
    assert problem.residual(result.solution) <= RTOL


def test_auto_falls_back_from_a_method_that_gives_up() -> None:
    """n = 180 rows > P = 131 parameters: Θ has a null space, where block steps stall. An auto whose order tries
    "block" first (the real methods of the table) gives up on it and CG goes on from its α to convergence."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)).double()  # P = 131
    x = torch.randn(60, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = np.random.default_rng(2).standard_normal((60, K))
    matrix = _example_major(reference_ntk(model, x))
    problem = Problem(model, x, x, y, matrix, matrix, 1e-2 * float(np.mean(np.diag(matrix))))
    options = SolverOptions(rtol=RTOL, block_size=20, landmarks=4)
    methods = {name: solver for name, solver in SOLVERS.items() if name != "auto"}
    auto = AutoSolver(methods, order=lambda _: ("block", "pcg"))
    held = HeldOut(ntk_operator(model, x[:5], x), y[:5], metric="mse")
    solved = make_problem(ntk_operator(model, x), y, ridge=problem.ridge, options=options, heldout=held)
    result = auto.solve(solved, options)
    assert [a.solver for a in result.attempts] == ["block", "pcg"]
    assert result.attempts[0].stop_reason.startswith("stagnated")
    assert result.solver == "pcg" and result.passes == pytest.approx(sum(a.passes for a in result.attempts))
    # one held-out curve over both methods, on one passes axis: CG's points come after the block method's passes
    passes = [p for p, _ in result.heldout_curve]
    assert passes == sorted(passes) and passes[-1] <= result.passes + 1e-9
    assert sum(p <= result.attempts[0].passes for p in passes) >= 2 and passes[-1] > result.attempts[0].passes
    _check_guarantee(problem, result)


def test_auto_resumed_at_a_checkpoint_of_its_fallback_repeats_the_rest_bit_for_bit() -> None:
    """NOTE [exact resume] through auto: cut at a checkpoint of CG after the block method gave up, resumed (extras
    through JSON): CG alone goes on, and the answer, the attempts and the one held-out curve are the whole run's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)).double()  # P = 131 < n = 180
    x = torch.randn(60, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = np.random.default_rng(2).standard_normal((60, K))
    options = SolverOptions(rtol=RTOL, block_size=20, landmarks=4, checkpoint_every=10)
    auto = AutoSolver({name: s for name, s in SOLVERS.items() if name != "auto"}, order=lambda _: ("block", "pcg"))
    held = HeldOut(ntk_operator(model, x[:5], x), y[:5], metric="mse")
    lam = 1e-2 * float(np.mean(np.diag(_example_major(reference_ntk(model, x)))))
    problem = make_problem(ntk_operator(model, x), y, ridge=lam, options=options, heldout=held)
    cuts: list[Progress] = []
    whole = auto.solve(
        problem, options, progress=lambda p: cuts.append(p) if p.checkpoint and p.solver == "pcg" else None
    )
    assert [a.solver for a in whole.attempts] == ["block", "pcg"] and whole.converged and len(cuts) >= 2
    cut = cuts[1].state
    assert cuts[1].heldout_curve == whole.heldout_curve[: len(cuts[1].heldout_curve)]  # live: the same one curve
    stored = dataclasses.replace(cut, extras=json.loads(json.dumps(cut.extras)))
    rest = auto.solve(problem, options, state=stored)
    np.testing.assert_array_equal(rest.solution, whole.solution)
    assert [(a.solver, a.stop_reason, a.passes) for a in rest.attempts] == [
        (a.solver, a.stop_reason, a.passes) for a in whole.attempts
    ]
    assert rest.heldout_curve == whole.heldout_curve and rest.passes == whole.passes and rest.steps == whole.steps


def test_the_auto_order(wide: Problem) -> None:
    """NOTE [auto rule]: a dense kernel is factored; an operator of ≤ DENSE_MAX_ROWS rows too, then CG, the block
    method (FULL, with its model), dense; past DENSE_MAX_ROWS dense comes last, where it fits the budget, except
    for a TRACE operator, whose iterations cost k passes per column."""
    options = SolverOptions()
    dense = make_problem(wide.matrix.reshape(120, 3, 120, 3).transpose(0, 2, 1, 3), wide.y, ridge=1.0, options=options)
    assert auto_order(dense) == ("dense", "pcg")
    small = make_problem(ntk_operator(wide.model, wide.x), wide.y, ridge=1.0, options=options)
    assert auto_order(small) == ("dense", "pcg", "block")
    rows = DENSE_MAX_ROWS + 1
    identity = scipy.sparse.linalg.aslinearoperator(scipy.sparse.identity(rows))  # no model behind it
    large = make_problem(identity, np.ones(rows), ridge=1.0, options=options)
    assert auto_order(large) == ("pcg", "dense")
    result = solve_kernel(identity, np.ones(rows), ridge=1.0)  # (I + I) α = 1: CG in one step; dense never runs
    assert result.solver == "pcg" and result.converged and np.allclose(result.solution, 0.5)
    # a TRACE operator of a model costs k passes per column: dense first at any size, where it fits
    trace = make_problem(ntk_operator(wide.model, wide.x, mode="trace"), wide.y, ridge=1.0, options=options)
    large_trace = dataclasses.replace(trace.kernel, rows=rows, cols=rows, n=rows, m=rows)
    assert large_trace.passes_per_product == 3  # k
    assert auto_order(dataclasses.replace(trace, kernel=large_trace)) == ("dense", "pcg")


def test_a_solve_resumes_from_its_state(wide: Problem) -> None:
    op = ntk_operator(wide.model, wide.x)
    options = SolverOptions(solver="block", rtol=RTOL, max_passes=12, **BLOCK)  # type: ignore[arg-type]
    first = solve_kernel(op, wide.y, ridge=wide.ridge, options=options)
    assert not first.converged and first.stop_reason == "max_passes" and first.state is not None
    assert first.state.weights is not None and first.state.epochs >= 1
    options = SolverOptions(solver="block", rtol=RTOL, **BLOCK)  # type: ignore[arg-type]
    rest = solve_kernel(op, wide.y, ridge=wide.ridge, options=options, state=first.state)
    _check_guarantee(wide, rest)
    assert rest.passes > first.passes and rest.epochs > first.epochs  # the counters go on from the state


@pytest.mark.parametrize("solver", ["block", "pcg"])
def test_a_solve_resumed_at_a_checkpoint_repeats_the_rest_of_the_run_bit_for_bit(wide: Problem, solver: str) -> None:
    """NOTE [exact resume]: a solve cut after its second checkpoint and resumed from it (its extras through JSON,
    as a job stores them) ends with the uninterrupted run's α, counters and curves, bit for bit."""
    settings = {**BLOCK, "inner_steps": 2} if solver == "block" else {"checkpoint_every": 4}
    options = SolverOptions(solver=solver, rtol=RTOL, **settings)  # type: ignore[arg-type]
    heldout = HeldOut(ntk_operator(wide.model, wide.x_test, wide.x), np.ones((8, K)), metric="mse")
    op = ntk_operator(wide.model, wide.x)
    checkpoints: list[Progress] = []

    def keep(p: Progress) -> None:
        if p.checkpoint:
            checkpoints.append(p)

    whole = solve_kernel(op, wide.y, ridge=wide.ridge, options=options, heldout=heldout, progress=keep)
    assert whole.converged and len(checkpoints) >= 3, (whole.stop_reason, len(checkpoints))
    cut = checkpoints[1].state
    stored = dataclasses.replace(cut, extras=json.loads(json.dumps(cut.extras)))
    rest = solve_kernel(op, wide.y, ridge=wide.ridge, options=options, heldout=heldout, state=stored)
    np.testing.assert_array_equal(rest.solution, whole.solution)
    assert (rest.steps, rest.epochs, rest.passes, rest.products) == (
        whole.steps, whole.epochs, whole.passes, whole.products
    )  # fmt: skip
    assert rest.heldout_curve == whole.heldout_curve and rest.stop_reason == whole.stop_reason
    if solver == "block":
        assert rest.weights is not None and whole.weights is not None
        np.testing.assert_array_equal(rest.weights, whole.weights)
        assert rest.residual_curve == whole.residual_curve


def test_progress_is_reported_and_a_raise_stops_the_solve(wide: Problem) -> None:
    seen: list[Progress] = []

    class Cancelled(Exception):
        pass

    def progress(p: Progress) -> None:
        seen.append(p)
        if len(seen) == 3:
            raise Cancelled

    op = ntk_operator(wide.model, wide.x)
    with pytest.raises(Cancelled):
        solve_kernel(op, wide.y, ridge=wide.ridge, options=SolverOptions(solver="block", rtol=RTOL, **BLOCK),
                     progress=progress)  # type: ignore[arg-type]  # fmt: skip
    assert [p.epochs for p in seen] == [0, 1, 2] and seen[0].residual == 1.0
    assert seen[1].passes > seen[0].passes and seen[2].state.solution.shape == (360, 1)
    seen.clear()
    solve_kernel(op, wide.y, ridge=wide.ridge, options=SolverOptions(solver="pcg", rtol=RTOL), progress=seen.append)
    assert [p.steps for p in seen] == list(range(1, len(seen) + 1)) and seen[-1].estimate is not None


@pytest.mark.parametrize(("solver", "metric"), [("block", "accuracy"), ("pcg", "mse")])
def test_the_heldout_curve_is_the_metric_of_the_predictions(wide: Problem, solver: str, metric: str) -> None:
    targets = np.random.default_rng(5).standard_normal((8, K))
    heldout = HeldOut(ntk_operator(wide.model, wide.x_test, wide.x), targets, metric=metric)  # type: ignore[arg-type]
    settings = BLOCK if solver == "block" else {}
    options = SolverOptions(solver=solver, rtol=1e-6, **settings)  # type: ignore[arg-type]
    result = solve_kernel(ntk_operator(wide.model, wide.x), wide.y, ridge=wide.ridge, options=options, heldout=heldout)
    assert len(result.heldout_curve) >= 2
    passes = [p for p, _ in result.heldout_curve]
    assert passes == sorted(passes)
    predictions = (wide.cross @ result.solution[:, 0]).reshape(8, K)
    if metric == "mse":
        assert result.heldout_curve[-1][1] == pytest.approx(float(np.mean((predictions - targets) ** 2)), rel=1e-6)
    else:
        expected = float(np.mean(predictions.argmax(1) == targets.argmax(1)))
        assert result.heldout_curve[-1][1] == expected


def test_bad_input_is_refused_naming_the_field(wide: Problem) -> None:
    op = ntk_operator(wide.model, wide.x)
    for ridge in (0.0, -1.0, float("nan")):
        with pytest.raises(InvalidInput, match="ridge must be a finite number > 0"):
            solve_kernel(op, wide.y, ridge=ridge)
    for options, field in (
        (SolverOptions(solver="lu"), "options.solver"),
        (SolverOptions(solver="block", block_size=0), "block_size"),
        (SolverOptions(solver="block", block_size=10, landmarks=20), "landmarks"),
        (SolverOptions(solver="block", inner_steps=0), "inner_steps"),
        (SolverOptions(solver="block", block_size=10**6), "block_size"),
        (SolverOptions(rtol=2.0), "rtol"),
    ):
        with pytest.raises(InvalidInput, match=field):
            solve_kernel(op, wide.y, ridge=1.0, options=options)
    float32 = ntk_operator(wide.model.float(), wide.x.float())
    wide.model.double()
    with pytest.raises(InvalidInput, match="float32 products"):
        solve_kernel(float32, wide.y, ridge=1.0, options=SolverOptions(rtol=1e-8))
    heldout = HeldOut(ntk_operator(wide.model, wide.x_test, wide.x), np.zeros((7, K)))
    with pytest.raises(ShapeMismatch, match="heldout.targets"):
        solve_kernel(op, wide.y, ridge=1.0, options=SolverOptions(solver="block"), heldout=heldout)
    with pytest.raises(InvalidInput, match="heldout.metric"):
        solve_kernel(op, wide.y, ridge=1.0, options=SolverOptions(solver="pcg"), heldout=HeldOut(
            ntk_operator(wide.model, wide.x_test, wide.x), np.zeros((8, K)), metric="auc"))  # type: ignore[arg-type]  # fmt: skip
    with pytest.raises(InvalidInput, match="'block' cannot solve this problem: it needs a FULL operator"):
        solve_kernel(wide.matrix.reshape(120, 3, 120, 3).transpose(0, 2, 1, 3), wide.y, ridge=1.0,
                     options=SolverOptions(solver="block"))  # fmt: skip


def test_memory_is_estimated_and_refused_up_front(wide: Problem) -> None:
    op = ntk_operator(wide.model, wide.x)
    with pytest.raises(MemoryEstimateExceeded, match="no method fits") as refused:
        solve_kernel(op, wide.y, ridge=1.0, options=SolverOptions(memory_budget_bytes=10_000))
    assert all(name in str(refused.value) for name in ("dense", "block", "pcg"))
    assert refused.value.estimate_bytes > 10_000
    with pytest.raises(MemoryEstimateExceeded, match="solver 'block' needs about"):
        solve_kernel(op, wide.y, ridge=1.0, options=SolverOptions(solver="block", memory_budget_bytes=10_000))


def test_the_table_holds_every_solver_once() -> None:
    assert set(SOLVERS) == {"auto", "dense", "pcg", "block"}
    assert all(solver.name == name for name, solver in SOLVERS.items())


def test_a_solver_is_an_operator(wide: Problem) -> None:
    inverse = InverseOperator(ntk_operator(wide.model, wide.x), ridge=wide.ridge, options=SolverOptions(rtol=RTOL))
    v = np.random.default_rng(6).standard_normal((360, 2))
    got = inverse.matmat(torch.from_numpy(v)).numpy()
    expected = np.linalg.solve(wide.matrix + wide.ridge * np.eye(360), v)
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) <= 2 * wide.cond() * RTOL
    assert inverse.shape == (360, 360) and inverse.last is not None and inverse.last.converged
    with pytest.raises(InvalidInput, match="ridge"):
        InverseOperator(ntk_operator(wide.model, wide.x), ridge=0.0)


@pytest.mark.parametrize("solver", ["block", "dense"])
def test_gp_inference_through_the_table(wide: Problem, solver: str) -> None:
    cross = ntk_operator(wide.model, wide.x_test, wide.x)
    settings = BLOCK if solver == "block" else {}
    options = SolverOptions(rtol=1e-6, **settings)  # type: ignore[arg-type]
    # a relative ridge on an operator: its mean diagonal is read off the structured engine
    post = gp_inference(
        ntk_operator(wide.model, wide.x), wide.y, cross, ridge=1e-2, ridge_scale="relative", solver=solver,
        options=options,
    )  # fmt: skip
    assert post.ridge == pytest.approx(wide.ridge, rel=1e-12)
    expected = (wide.cross @ wide.cholesky()).reshape(8, K)
    assert post.solver == solver and post.solve is not None and post.solve.converged
    assert np.linalg.norm(post.mean - expected) / np.linalg.norm(expected) <= 2 * wide.cond() * 1e-6


@pytest.mark.parametrize("solver", ["pcg", "block"])
def test_the_heldout_metric_can_stop_the_solve(wide: Problem, solver: str) -> None:
    """With ``patience``, a solve stops once its held-out metric has not improved for that many evaluations
    (random targets: the MSE soon stops falling), and says so."""
    targets = np.random.default_rng(7).standard_normal((8, K))
    heldout = HeldOut(ntk_operator(wide.model, wide.x_test, wide.x), targets, metric="mse", patience=2)
    settings = BLOCK if solver == "block" else {}
    options = SolverOptions(solver=solver, rtol=RTOL, **settings)  # type: ignore[arg-type]
    result = solve_kernel(ntk_operator(wide.model, wide.x), wide.y, ridge=wide.ridge, options=options, heldout=heldout)
    assert result.stop_reason.startswith("heldout: no better mse") and not result.converged
    values = [v for _, v in result.heldout_curve]
    assert min(values[-2:]) >= min(values[:-2])  # the last two evaluations were no better than the best before
