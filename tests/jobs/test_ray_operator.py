"""ray_ntk_operator on a real local Ray instance (2 CPUs): products against the float64 reference kernel of
tests/reference.py (an independent per-example autograd loop) and against the in-process ntk_operator, a CG solve
through it against numpy's dense solve, the shard count's edges, and clear errors.

Actors start in seconds each (a process importing torch), so one operator over (x_test, x_train) serves most
tests through its views (``view``, ``T``): the model and data are shipped once."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from ntk_service.analysis import gp_inference, max_learning_rate, spectrum
from ntk_service.analysis.solve import CgOptions, SolverOptions, solve_kernel
from ntk_service.errors import (
    InvalidInput,
    JobFailed,
    NoMatchingParameters,
    NonFiniteInput,
    OptionalDependencyMissing,
    ShapeMismatch,
    UnknownMode,
)
from ntk_service.jobs.executors import RayNtkOperator, ray_ntk_operator
from ntk_service.jobs.executors.ray import RayExecutor, _command, _descendants
from ntk_service.jobs.kinds.solve import RayOperators
from ntk_service.jobs.solve_job import SolveOptions, run_solve
from ntk_service.kernels import ntk_operator
from tests.reference import reference_jacobian, reference_ntk
from tests.server.slow_factory import SlowLinear

K = 3
ACTOR_CPUS = 0.25
"""Each actor reserves a quarter CPU, so the module's operators fit the 2-CPU instance side by side."""


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, K)).double()


def _data() -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    g = torch.Generator().manual_seed(1)
    x_train = torch.randn(12, 4, generator=g, dtype=torch.float64)
    x_test = torch.randn(5, 4, generator=g, dtype=torch.float64)
    y = np.random.default_rng(2).standard_normal((12, K))
    return x_train, x_test, y


def _matrix(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor | None, mode: str) -> torch.Tensor:
    """The reference kernel as the operator's matrix: example-major (N·k, M·k) for FULL, (N, M) otherwise."""
    theta = reference_ntk(model, x1, x2, mode=mode)
    if mode != "full":
        return theta
    n, m = theta.shape[:2]
    return theta.permute(0, 2, 1, 3).reshape(n * K, m * K)


def _rel(got: torch.Tensor | np.ndarray, expected: torch.Tensor | np.ndarray) -> float:
    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


@pytest.fixture(scope="module")
def test_train(ray_instance: object) -> Iterator[RayNtkOperator]:
    """Θ(x_test, x_train), FULL, on 2 shards (x_test 5 = 2 + 3 rows, x_train 12 = 6 + 6)."""
    x_train, x_test, _ = _data()
    with ray_ntk_operator(_mlp(), x_test, x_train, shards=2, num_cpus=ACTOR_CPUS) as op:
        yield op


@pytest.mark.parametrize("mode", ["full", "trace", "pseudo"])
def test_products_equal_the_reference_and_the_in_process_operator(test_train: RayNtkOperator, mode: str) -> None:
    model = _mlp()
    x_train, x_test, _ = _data()
    g = torch.Generator().manual_seed(3)
    sets = {"x1": x_test, "x2": x_train}
    for rows, cols in (("x1", "x2"), ("x2", "x2"), ("x2", "x1")):
        op = test_train.view(rows=rows, cols=cols, mode=mode)
        x_rows, x_cols = sets[rows], sets[cols]
        dense = _matrix(model, x_rows, None if rows == cols else x_cols, mode)
        local = ntk_operator(model, x_rows, None if rows == cols else x_cols, mode=mode)
        assert op.shape == tuple(dense.shape) == local.shape and op.shards == 2
        assert op.is_symmetric == (rows == cols) and op.k == K and op.num_params == local.num_params
        per = (K,) if mode == "full" else ()
        v = torch.randn(len(x_cols), *per, generator=g, dtype=torch.float64)
        got = op.matvec(v)
        assert got.dtype == torch.float64 and got.shape == (len(x_rows), *per)
        assert _rel(got.reshape(-1), dense @ v.reshape(-1)) <= 1e-10
        assert _rel(got, local.matvec(v)) <= 1e-10
        w = torch.randn(dense.shape[0], generator=g, dtype=torch.float64)
        assert _rel(op.rmatvec(w).reshape(-1), dense.T @ w) <= 1e-10  # flat in, flat out for FULL
        assert _rel(op.T.matvec(w).reshape(-1), dense.T @ w) <= 1e-10


@pytest.mark.parametrize("mode", ["full", "trace"])
def test_cg_through_the_ray_operator_equals_the_dense_solve(test_train: RayNtkOperator, mode: str) -> None:
    model = _mlp()
    x_train, x_test, y = _data()
    lam = 1e-2
    a = _matrix(model, x_train, None, mode).numpy()
    c = _matrix(model, x_test, x_train, mode).numpy()
    if mode == "full":
        alpha = np.linalg.solve(a + lam * np.eye(a.shape[0]), y.reshape(-1))
        expected = (c @ alpha).reshape(-1, K)
    else:  # our TRACE kernel is the sum over outputs, read as (trace / k) ⊗ I_k (NOTE [operator layout])
        alpha = np.linalg.solve(a / K + lam * np.eye(a.shape[0]), y)
        expected = c / K @ alpha
    train, cross = test_train.view(rows="x2", mode=mode), test_train.view(mode=mode)
    options = CgOptions(rtol=1e-12, preconditioner="nystrom", landmarks=6)
    posterior = gp_inference(train, y, cross, ridge=lam, cg=options)
    assert posterior.solver == "cg" and posterior.solve is not None and posterior.solve.converged
    assert _rel(posterior.mean, expected) <= 1e-6
    assert _rel(posterior.solve.solution.reshape(alpha.shape), alpha) <= 1e-6
    # the operator says its mode: a TRACE product is reported as k passes, as for an NtkOperator
    assert posterior.solve.passes == posterior.solve.products * (K if mode == "trace" else 1)


def test_the_jacobian_halves_on_the_shards_equal_the_reference(test_train: RayNtkOperator) -> None:
    """jvp / vjp / kernel_block of the Ray operator, each range on the actor of its shard (x_train 12 = 6 + 6)."""
    model = _mlp()
    x_train, x_test, _ = _data()
    train = test_train.view(rows="x2")
    assert train.partitions() == [(0, 6), (6, 12)] and train.examples == (12, 12)
    jac = reference_jacobian(model, x_train).numpy()
    rng = np.random.default_rng(4)
    u = rng.standard_normal(train.num_params)
    ranges = [(2, 5), (5, 9), (11, 12)]  # across the shard boundary
    rows = np.concatenate([np.arange(a, b) for a, b in ranges])
    np.testing.assert_allclose(train.jvp(u, ranges), jac[rows] @ u, rtol=0, atol=1e-12)
    c = rng.standard_normal((rows.size, K))
    np.testing.assert_allclose(train.vjp(c, ranges), np.einsum("nkp,nk->p", jac[rows], c), rtol=0, atol=1e-12)
    landmarks = np.array([10, 1, 7])
    expected = reference_ntk(model, x_train[rows], x_train[landmarks]).numpy()
    np.testing.assert_allclose(train.kernel_block(ranges, landmarks), expected, rtol=0, atol=1e-12)
    test_rows = reference_jacobian(model, x_test).numpy()
    np.testing.assert_allclose(test_train.jvp(u), test_rows @ u, rtol=0, atol=1e-12)  # J(x_test) w


def test_the_block_solver_on_the_shards_equals_the_local_one(test_train: RayNtkOperator) -> None:
    """The parameter-space block method with its blocks on the shard actors (w shipped once a step): the same
    answer as in one process to 1e-6, both within their guarantee of the dense solve."""
    model = _mlp()
    x_train, x_test, y = _data()
    lam = 1e-2
    a = _matrix(model, x_train, None, "full").numpy()
    alpha = np.linalg.solve(a + lam * np.eye(a.shape[0]), y.reshape(-1))
    options = SolverOptions(solver="block", rtol=1e-9, block_size=6, landmarks=2, inner_steps=4)
    sharded = solve_kernel(test_train.view(rows="x2"), y, ridge=lam, options=options)
    local = solve_kernel(ntk_operator(model, x_train), y, ridge=lam, options=options)
    assert sharded.converged and local.converged and sharded.solver == local.solver == "block"
    assert _rel(sharded.solution[:, 0], local.solution[:, 0]) <= 1e-6
    assert _rel(sharded.solution[:, 0], alpha) <= 1e-6
    assert sharded.weights is not None  # J(x_test) w on the shards: the test predictions
    c = _matrix(model, x_test, x_train, "full").numpy()
    assert _rel(test_train.jvp(sharded.weights).reshape(-1), c @ alpha) <= 1e-6


def test_lanczos_through_the_ray_operator_finds_the_dense_eigenvalues(test_train: RayNtkOperator) -> None:
    model = _mlp()
    x_train, _, _ = _data()
    full = test_train.view(rows="x2")
    dense = np.linalg.eigvalsh(_matrix(model, x_train, None, "full").numpy())
    np.testing.assert_allclose(spectrum(full, top=2).eigenvalues, dense[::-1][:2], rtol=1e-8)
    trace = np.linalg.eigvalsh(_matrix(model, x_train, None, "trace").numpy())
    # a TRACE operator is read as (trace / k) ⊗ I_k, with MSELoss over N·k entries, as for an NtkOperator
    n = len(x_train)
    assert max_learning_rate(full.view(mode="trace")) == pytest.approx(n * K / (trace[-1] / K), rel=1e-8)


class _Keywords(nn.Module):
    """Keyword inputs (token ids, an integer mask) and a dict output: the mapping path through the object store."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lin = nn.Embedding(9, 4), nn.Linear(4, K)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = torch.tanh(self.emb(input_ids)) * attention_mask.unsqueeze(-1)
        return {"logits": self.lin(hidden.sum(1))}


def test_one_shard_and_more_shards_than_examples(ray_instance: object) -> None:
    # S = 1 is the in-process product through one actor (here with keyword inputs and a selected output); S > N
    # is clamped to N, one example per actor: an actor without rows would hold a model and add nothing, and the
    # clamp lets one shard count serve any data size
    torch.manual_seed(1)
    g = torch.Generator().manual_seed(5)
    tokens = _Keywords().double()
    x = {"input_ids": torch.randint(0, 9, (4, 3), generator=g), "attention_mask": torch.ones(4, 3, dtype=torch.int64)}
    x["attention_mask"][0, 2] = 0
    full = reference_ntk(tokens, x, output=lambda out: out["logits"])
    dense = full.permute(0, 2, 1, 3).reshape(4 * K, 4 * K)
    v = torch.randn(4, K, generator=g, dtype=torch.float64)
    with ray_ntk_operator(tokens, x, shards=1, output="logits", num_cpus=ACTOR_CPUS) as op:
        assert op.shards == 1 and op.is_symmetric and op.shape == (4 * K, 4 * K)
        assert _rel(op.matvec(v).reshape(-1), dense @ v.reshape(-1)) <= 1e-10
    with pytest.raises(InvalidInput, match="the operator was closed"):
        op.matvec(v)
    model = _mlp()
    x2 = torch.randn(2, 4, generator=g, dtype=torch.float64)
    with ray_ntk_operator(model, x2, shards=5, num_cpus=ACTOR_CPUS) as op:
        assert op.shards == 2 and op.shape == (2 * K, 2 * K)
        assert _rel(op.matvec(v[:2]).reshape(-1), _matrix(model, x2, None, "full") @ v[:2].reshape(-1)) <= 1e-10


def test_bad_inputs_are_refused_clearly(test_train: RayNtkOperator) -> None:
    x_train, x_test, _ = _data()
    with pytest.raises(ShapeMismatch, match=r"ray_ntk_operator.matvec: the vector has shape \(5, 3\).*\(12, 3\)"):
        test_train.matvec(torch.zeros(5, K, dtype=torch.float64))
    with pytest.raises(ShapeMismatch, match=r"ray_ntk_operator.rmatvec: .*\(12,\)"):
        test_train.view(mode="trace").rmatvec(torch.zeros(12, dtype=torch.float64))
    with pytest.raises(NonFiniteInput, match="NaN or inf"):
        test_train.matvec(torch.full((12, K), float("nan"), dtype=torch.float64))
    with pytest.raises(InvalidInput, match=r"rows must be 'x1' or 'x2', got 'x3'"):
        test_train.view(rows="x3")
    with pytest.raises(UnknownMode, match="not a linear operator"):
        test_train.view(mode="example_diagonal")
    for shards in (0, True, 1.5):
        with pytest.raises(InvalidInput, match="shards must be an integer ≥ 1"):
            ray_ntk_operator(_mlp(), x_test, shards=shards)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="num_cpus must be a number > 0"):
        ray_ntk_operator(_mlp(), x_test, num_cpus=0)
    with pytest.raises(ShapeMismatch, match="per-example shape"):
        ray_ntk_operator(_mlp(), x_test, torch.zeros(3, 5, dtype=torch.float64))
    # an error of the engine in an actor comes back as itself, not wrapped by Ray
    with pytest.raises(NoMatchingParameters):
        ray_ntk_operator(_mlp(), x_test, params=["nothing.*"], shards=1, num_cpus=ACTOR_CPUS)


def _shard_worker_pids() -> dict[int, str]:
    """The live Ray ShardWorker processes under this test process: {pid: command line (Ray's process title)}."""
    found = {}
    for pid in _descendants(os.getpid()):
        command = _command(pid)
        if "ShardWorker" in command:
            found[pid] = command
    return found


def test_an_actor_killed_mid_product_fails_the_product_clearly(ray_instance: object, tmp_path: Path) -> None:
    """A shard's actor process killed while a product waits on it: the product raises JobFailed saying so (it does
    not hang, nor return the other shard's part as the sum), and so does the next product."""
    gate = tmp_path / "gate"
    gate.touch()  # open while the operator is built and its first product runs
    torch.manual_seed(0)
    model = SlowLinear(4, 2, delay_s=0.0, gate=str(gate)).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    v = torch.randn(6, 2, dtype=torch.float64)
    before = set(_shard_worker_pids())
    with ray_ntk_operator(model, x, shards=2, num_cpus=ACTOR_CPUS) as op:
        theta = reference_ntk(model, x, mode="full").permute(0, 2, 1, 3).reshape(12, 12)  # k = 2
        assert _rel(op.matvec(v), (theta @ v.reshape(-1)).reshape(6, 2)) < 1e-12
        ours = set(_shard_worker_pids()) - before
        assert len(ours) == 2
        gate.unlink()  # the next product's pullbacks wait in the model's forward
        outcome: dict[str, BaseException] = {}

        def product() -> None:
            try:
                op.matvec(v)
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                outcome["error"] = exc

        thread = threading.Thread(target=product)
        thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            running = [pid for pid, command in _shard_worker_pids().items() if pid in ours and "pullback" in command]
            if running:
                break
            time.sleep(0.05)
        assert running, _shard_worker_pids()
        os.kill(running[0], signal.SIGKILL)
        time.sleep(0.5)
        gate.touch()  # the other shard's call completes
        thread.join(60)
        assert not thread.is_alive(), "the product hung on a dead actor"
        error = outcome.get("error")
        assert isinstance(error, JobFailed), error
        assert "the actor of a shard died" in error.message and "build it again" in error.message
        with pytest.raises(JobFailed, match="the actor of a shard died"):
            op.matvec(v)


def test_missing_ray_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` sees without the extra installed
    x = torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(
        OptionalDependencyMissing, match=r"ray_ntk_operator: needs Ray.*pip install 'ntk-service\[ray\]'"
    ):
        ray_ntk_operator(_mlp(), x)


def test_a_solve_job_on_ray_runs_its_solver_on_the_shard_actors(ray_instance: object) -> None:
    """What a solve job runs where its executor is Ray (``RayOperators``: w replicated, the block method's passes
    on the shard actors): numpy's dense solve to 1e-6. One operator (two actors): a test set or a held-out set
    would each ship the model to two more, and their path is the local one's (tests/server/routes)."""
    model = _mlp()
    x_train, _, y = _data()
    lam = 1e-2
    a = _matrix(model, x_train, None, "full").numpy()
    alpha = np.linalg.solve(a + lam * np.eye(a.shape[0]), y.reshape(-1))
    spec = SolveOptions(kind="kernel_ridge", ridge=lam, rtol=1e-9, solver="block", block_size=6, landmarks=2,
                        inner_steps=4)  # fmt: skip
    operators = RayOperators(model, spec, RayExecutor(num_cpus=ACTOR_CPUS, actors=2))
    try:
        outcome = run_solve(spec, model, x_train.numpy(), y, None, k=K, operators=operators)
        assert [type(op).__name__ for op in operators.built] == ["RayNtkOperator"]
    finally:
        operators.close()
    assert outcome.report.converged and outcome.report.solver == "block" and outcome.report.epochs >= 1
    assert _rel(outcome.alpha.reshape(-1), alpha) <= 1e-6
