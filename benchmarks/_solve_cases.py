"""The solver table's benchmark cases (issue 38, "What must be shown" 1-5), run as sections of bench_solvers.py.

- ``auto``: where dense fits, ``solver="auto"`` against scipy's Cholesky on the dense kernel (compute_ntk + factor),
  alternated in one process: FULL N on the benchmark MLP (float64), and a float64 ill-conditioned problem (a
  small tanh MLP, k = 3) at ridges 1e-6, 1e-3 and 1 × the mean diagonal. Prints both walls, the ratio, the method
  auto ran and the relative difference of the test predictions.
- ``solve``: the scale run: FULL kernel ridge on N examples with M held-out ones by ``solve_kernel`` (each
  ``--solvers`` entry in turn: auto, pcg, block), float32 products: passes, steps, the true residual, the held-out
  accuracy curve, wall, peak RSS; ``--reference-rtol`` adds a float64 solve to that rtol whose held-out accuracy
  the others are compared with.
- ``trace``: what a TRACE solve costs: auto on the TRACE operator under a time limit, with the cost per iteration
  and the projection to convergence.
- ``ray-solve``: the same solve on ``ray_ntk_operator`` (``--shards`` one-thread actors) and in one process:
  the relative difference of the answers and the seconds per pass of each, alternated.
- ``ridge``: ``estimate_ridge`` on the operator (GCV, LOO along the default grid) against the held-out accuracy
  of a solve at each of a few ridges.
- ``job``: the solve job's path (``run_solve``, its checkpoints written to disk) against ``solve_kernel`` on the
  same memory-mapped data, alternated; pcg at each ``--progress-every`` (the job's restarts).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import scipy.linalg
import torch
from torch import nn

from benchmarks._models import make_inputs, make_mlp
from ntk_service.analysis.blas_guard import large_matrix_blas
from ntk_service.analysis.solve import CgOptions, HeldOut, SolverOptions, estimate_ridge, solve_kernel
from ntk_service.jobs.executors import import_ray, ray_ntk_operator
from ntk_service.kernels import compute_ntk, ntk_operator

K = 10


def _peak_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _load() -> str:
    return " ".join(f"{v:.1f}" for v in os.getloadavg())


def _classes(x: torch.Tensor, k: int = K, seed: int = 5) -> np.ndarray:
    """The classes of a fixed random linear teacher (bench_solvers.py's ``_labels``, as indices)."""
    teacher = torch.randn(x.shape[1], k, generator=torch.Generator().manual_seed(seed), dtype=x.dtype)
    return (x @ teacher).argmax(1).numpy()


def _onehot(classes: np.ndarray, k: int = K) -> np.ndarray:
    return np.eye(k)[classes] - 1.0 / k


def _cholesky_predictions(model: nn.Module, x: torch.Tensor, xq: torch.Tensor, y: np.ndarray, lam: float) -> np.ndarray:
    theta = compute_ntk(model, x, mode="full", dtype="float64").theta
    n, k = y.shape
    a = theta.permute(0, 2, 1, 3).reshape(n * k, n * k).numpy()
    del theta
    a[np.diag_indices_from(a)] += lam
    with large_matrix_blas(n * k):  # NOTE [large blas]: the multithreaded bundled OpenBLAS crashes from n ≈ 16,000
        alpha = scipy.linalg.cho_solve(scipy.linalg.cho_factor(a, lower=True, overwrite_a=True), y.reshape(-1))
    del a
    cross = compute_ntk(model, xq, x, mode="full", dtype="float64").theta
    m = xq.shape[0]
    return np.asarray(cross.permute(0, 2, 1, 3).reshape(m * k, n * k).numpy() @ alpha).reshape(m, k)


def _auto_predictions(model: nn.Module, x: torch.Tensor, xq: torch.Tensor, y: np.ndarray, lam: float) -> tuple:
    result = solve_kernel(ntk_operator(model, x, dtype=torch.float64), y, ridge=lam)
    cross = ntk_operator(model, xq, x, dtype=torch.float64)
    if result.weights is not None:
        predictions = cross.jvp(result.weights)
    else:
        predictions = cross.matmat_float64(result.solution).reshape(xq.shape[0], y.shape[1])
    return predictions, result


def section_auto(n: int, repeats: int) -> None:
    """Issue 38 item 1: auto against scipy's Cholesky where dense fits, alternated in this process."""
    cases = [("MLP 784-512-512-10, FULL", make_mlp().double(), make_inputs("mlp", n + 200).double(), 1e-3)]
    torch.manual_seed(0)
    tanh = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 3)).double()
    xs = torch.randn(500, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for ridge in (1e-6, 1e-3, 1.0):
        cases.append((f"tanh MLP 8-64-3, N = 300, ridge {ridge:g}", tanh, xs, ridge))
    print(f"auto vs scipy Cholesky (dense kernel by compute_ntk, float64), {repeats} alternations, ridge × mean "
          f"diagonal, load {_load()}")  # fmt: skip
    print(f"{'case':<42} {'cholesky s':>10} {'auto s':>8} {'auto/chol':>9} {'method':>7} {'passes':>7} "
          f"{'residual':>9} {'rel diff':>9}  load")  # fmt: skip
    for label, model, x_all, relative in cases:
        size = n if "FULL" in label else 300
        x, xq = x_all[:size], x_all[size : size + 200]
        k = 10 if "FULL" in label else 3
        y = _onehot(_classes(x, k), k)
        diag = compute_ntk(model, x[:64], mode="example_diagonal", dtype="float64").theta
        lam = relative * float(diag.diagonal(dim1=1, dim2=2).mean())
        walls: dict[str, list[float]] = {"cholesky": [], "auto": []}
        for _ in range(repeats):
            start = time.perf_counter()
            dense = _cholesky_predictions(model, x, xq, y, lam)
            walls["cholesky"].append(time.perf_counter() - start)
            start = time.perf_counter()
            predictions, result = _auto_predictions(model, x, xq, y, lam)
            walls["auto"].append(time.perf_counter() - start)
        chol, auto = float(np.median(walls["cholesky"])), float(np.median(walls["auto"]))
        diff = float(np.linalg.norm(predictions - dense) / np.linalg.norm(dense))
        verdict = "" if result.converged else f"  NOT CONVERGED ({result.stop_reason})"
        print(f"{label:<42} {chol:>10.2f} {auto:>8.2f} {auto / chol:>9.2f} {result.solver:>7} {result.passes:>7.1f} "
              f"{result.residual.max():>9.1e} {diff:>9.1e}  {_load()}{verdict}", flush=True)  # fmt: skip


def section_solve(
    n: int, m: int, solvers: list[str], rtol: float, ridge: float, minutes: float | None, reference_rtol: float | None
) -> None:
    """Issue 38 items 2 and 3: the FULL solve at scale with a held-out set, each solver in turn in this process."""
    model = make_mlp()
    x_all = make_inputs("mlp", n + m)
    x, xq = x_all[:n], x_all[n:]
    classes = _classes(x_all)
    y, held = _onehot(classes[:n]), classes[n:]
    diag = compute_ntk(model, x[:64], mode="example_diagonal").theta.diagonal(dim1=1, dim2=2).mean()
    lam = ridge * float(diag)
    print(f"FULL kernel ridge by solve_kernel, MLP 784-512-512-10, N = {n}, {m} held-out, ridge {ridge:g} × mean "
          f"diagonal, rtol {rtol:g}, float32 products, load {_load()}")  # fmt: skip
    reference = None
    if reference_rtol is not None:
        ref = _run(model, x, xq, y, held, lam, "auto", reference_rtol, minutes, torch.float64)
        reference = ref.heldout_curve[-1][1] if ref.heldout_curve else None
    for solver in solvers:
        result = _run(model, x, xq, y, held, lam, solver, rtol, minutes, torch.float32)
        accuracy = result.heldout_curve[-1][1] if result.heldout_curve else float("nan")
        if reference is not None:
            print(f"  held-out accuracy {accuracy:.4f} against {reference:.4f} at rtol {reference_rtol:g}: "
                  f"{100 * (accuracy - reference):+.2f} points")  # fmt: skip


def _run(model, x, xq, y, held, lam, solver, rtol, minutes, dtype):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    train = ntk_operator(model, x, dtype=dtype)
    cross = ntk_operator(model, xq, x, dtype=dtype)
    options = SolverOptions(solver=solver, rtol=rtol, max_seconds=None if minutes is None else 60 * minutes)

    def progress(p) -> None:  # type: ignore[no-untyped-def]
        if p.epochs or p.steps % 10 == 0:
            print(f"    {p.solver} step {p.steps} epoch {p.epochs} passes {p.passes:.1f} residual {p.residual} "
                  f"estimate {p.estimate} held-out {p.heldout} {p.elapsed_s:.0f} s", flush=True)  # fmt: skip

    result = solve_kernel(train, y, ridge=lam, options=options, heldout=HeldOut(cross, held, every=5),
                          progress=progress)  # fmt: skip
    wall = time.perf_counter() - start
    accuracy = result.heldout_curve[-1][1] if result.heldout_curve else float("nan")
    verdict = "converged" if result.converged else f"NOT CONVERGED ({result.stop_reason})"
    attempts = ", ".join(f"{a.solver}: {a.stop_reason[:40]} after {a.passes:.1f} passes" for a in result.attempts)
    print(f"  {solver} ({dtype}): {verdict}, method {result.solver} [{attempts or '-'}], residual "
          f"{result.residual.max():.2e}, passes {result.passes:.1f}, steps {result.steps}, preconditioner "
          f"{result.preconditioner}, wall {wall:.1f} s, peak {_peak_mib():.0f} MiB (estimate "
          f"{result.memory_bytes / 2**20:.0f} MiB), held-out accuracy {accuracy:.4f}, load {_load()}")  # fmt: skip
    curve = " ".join(f"{p:.0f}:{v:.3f}" for p, v in result.heldout_curve)
    print(f"    held-out curve (passes:accuracy) {curve}", flush=True)
    return result


def section_trace(n: int, minutes: float, ridge: float) -> None:
    """Issue 38 item 4: what a TRACE solve costs. First one product of each operator on one column, alternated
    (TRACE: k VJP + JVP passes per column; FULL: one), then (``minutes`` > 0) a TRACE solve of the k target
    columns under that time limit: k² passes per iteration."""
    model = make_mlp()
    x = make_inputs("mlp", n)
    y = _onehot(_classes(x))
    walls: dict[str, list[float]] = {"full": [], "trace": []}
    ops = {mode: ntk_operator(model, x, mode=mode) for mode in walls}
    rng = np.random.default_rng(0)
    for _ in range(2):
        for mode, op in ops.items():
            v = rng.standard_normal(op.shape[1]).astype(np.float32)
            start = time.perf_counter()
            op @ torch.from_numpy(v)
            walls[mode].append(time.perf_counter() - start)
    full_s, trace_s = min(walls["full"]), min(walls["trace"])
    print(
        f"one product on one column, N = {n}: FULL {full_s:.1f} s (one pass), TRACE {trace_s:.1f} s "
        f"({trace_s / full_s:.1f} FULL passes; k = {K}), best of 2 alternated, load {_load()}",
        flush=True,
    )
    if minutes <= 0:
        return
    # TRACE's diagonal entry is the sum of the k outputs' (the ridge is relative to the kernel it regularises)
    diag = compute_ntk(model, x[:64], mode="example_diagonal").theta.diagonal(dim1=1, dim2=2).sum(1).mean()
    start = time.perf_counter()
    options = SolverOptions(rtol=1e-3, max_seconds=60 * minutes)
    result = solve_kernel(ops["trace"], y, ridge=ridge * float(diag), options=options)
    wall = time.perf_counter() - start
    per = wall / max(result.steps, 1)
    print(f"TRACE kernel ridge, MLP 784-512-512-10, N = {n}, k = {K} target columns, rtol 1e-3: method "
          f"{result.solver}, {result.steps} iterations, {result.passes:.0f} passes (k per product), "
          f"residual {result.residual.max():.2e}, {result.stop_reason}, wall {wall:.0f} s ({per:.1f} s per "
          f"iteration), peak {_peak_mib():.0f} MiB, load {_load()}")  # fmt: skip


def section_ray_solve(n: int, shards: int, rtol: float, solver: str, iterations: int | None = None) -> None:
    """Issue 38 item 5: the solve on ``shards`` Ray actors against one process: the answers and s / pass.

    ``iterations``: instead of a solve to ``rtol``, both run exactly that many CG iterations with no preconditioner
    (the same Krylov sequence, so the iterates are comparable long before convergence: at N = 100,000 a converged
    solve is an hour each way). Otherwise ``solver`` to ``rtol``.
    """
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray = import_ray()
    ray.init(address="local", num_cpus=shards, include_dashboard=False, log_to_driver=False)
    model = make_mlp()
    x = make_inputs("mlp", n)
    y = _onehot(_classes(x))
    diag = compute_ntk(model, x[:64], mode="example_diagonal").theta.diagonal(dim1=1, dim2=2).mean()
    lam = 1e-3 * float(diag)
    if iterations is None:
        options = SolverOptions(solver=solver, rtol=rtol)
    else:
        cg = CgOptions(rtol=1e-5, max_iterations=iterations, preconditioner="none")
        options = SolverOptions(solver="pcg", rtol=1e-5, cg=cg)  # the float32 floor: no early stop
    runs = {}
    with ray_ntk_operator(model, x, shards=shards, num_cpus=1) as sharded:
        for label, op in (("local", ntk_operator(model, x)), ("ray", sharded)):
            start = time.perf_counter()
            result = solve_kernel(op, y, ridge=lam, options=options)
            runs[label] = (time.perf_counter() - start, result)
    ray.shutdown()
    (local_s, local), (ray_s, remote) = runs["local"], runs["ray"]
    diff = float(np.linalg.norm(remote.solution - local.solution) / np.linalg.norm(local.solution))
    what = f"{iterations} CG iterations, no preconditioner" if iterations else f"{solver} solve to rtol {rtol:g}"
    print(f"{what}, FULL, N = {n}: local {local.solver} {local.passes:.1f} passes in {local_s:.1f} s "
          f"({local_s / max(local.passes, 1):.2f} s/pass, residual {local.residual.max():.2e}); ray ({shards} actors) "
          f"{remote.solver} {remote.passes:.1f} passes in {ray_s:.1f} s ({ray_s / max(remote.passes, 1):.2f} s/pass, "
          f"residual {remote.residual.max():.2e}); throughput ray/local "
          f"{(local_s / max(local.passes, 1)) / (ray_s / max(remote.passes, 1)):.2f}; relative difference of α "
          f"{diff:.1e}; peak {_peak_mib():.0f} MiB (this process); load {_load()}")  # fmt: skip


def section_ridge(n: int, m: int, ridges: list[float]) -> None:
    """``estimate_ridge`` (GCV, LOO from the Nyström basis) against the held-out accuracy of solves at a few ridges."""
    model = make_mlp()
    x_all = make_inputs("mlp", n + m)
    x, xq = x_all[:n], x_all[n:]
    classes = _classes(x_all)
    y = _onehot(classes[:n])
    start = time.perf_counter()
    est = estimate_ridge(ntk_operator(model, x), y)
    print(f"estimate_ridge, MLP 784-512-512-10, N = {n}: rank {est.rank}, floor {est.floor / est.mean_diagonal:.3f} × "
          f"mean diagonal, {time.perf_counter() - start:.1f} s; best GCV {est.best_gcv / est.mean_diagonal:.1e}, "
          f"best LOO {est.best_loo / est.mean_diagonal:.1e} (× mean diagonal)")  # fmt: skip
    for rel, gcv, loo in zip(est.ridges / est.mean_diagonal, est.gcv, est.loo, strict=True):
        print(f"  ridge {rel:.1e}: GCV {gcv:.4f} LOO {loo:.4f}")
    cross = ntk_operator(model, xq, x)
    for rel in ridges:
        result = solve_kernel(ntk_operator(model, x), y, ridge=rel * est.mean_diagonal,
                              options=SolverOptions(rtol=1e-3), heldout=HeldOut(cross, _onehot(classes[n:]),
                              metric="mse"))  # fmt: skip
        print(f"  solve at ridge {rel:.1e} × mean diagonal ({result.solver}): held-out MSE "
              f"{result.heldout_curve[-1][1]:.4f} (LOO: the same error, on the train set)")  # fmt: skip


def section_job(n: int, m: int, solvers: list[str], rtol: float, ridge: float, repeats: int, every: list[int]) -> None:
    """The solve job's path against the library's: ``run_solve`` (what a job runs: every pass through the job's
    wrapper, each checkpoint written as state.npz) and ``solve_kernel``, both on a ``dataset_operator`` over the
    same memory-mapped .npy files, alternated ``repeats`` times in one process, for each of ``solvers``; for "pcg"
    each ``every`` (CG iterations between the job's checkpoints, each a restart) in turn: what the checkpoints cost
    in passes and wall time."""
    import tempfile

    from ntk_service.jobs.solve_job import HeldOutRows, SolveOptions, local_operators, run_solve, solver_options

    model = make_mlp()
    x_all = make_inputs("mlp", n + m)
    classes = _classes(x_all)
    folder = Path(tempfile.mkdtemp(prefix="bench-solve-job-"))
    np.save(folder / "x.npy", x_all[:n].numpy())
    np.save(folder / "xq.npy", x_all[n:].numpy())
    x = np.load(folder / "x.npy", mmap_mode="r")
    xq = np.load(folder / "xq.npy", mmap_mode="r")
    y, held = _onehot(classes[:n]), classes[n:].astype(np.float64)
    diag = compute_ntk(model, x_all[:64], mode="example_diagonal").theta.diagonal(dim1=1, dim2=2).mean()
    lam = ridge * float(diag)
    print(f"The solve job's path (run_solve, checkpoints to disk) against solve_kernel, MLP 784-512-512-10, FULL, "
          f"N = {n}, {m} held-out, ridge {ridge:g} × mean diagonal, rtol {rtol:g}, float32, "
          f"load {_load()}")  # fmt: skip
    for solver in solvers:
        for segment in every if solver == "pcg" else every[:1]:
            spec = SolveOptions(kind="kernel_ridge", dtype="float32", ridge=lam, rtol=rtol, solver=solver,
                                progress_every=segment, heldout_metric="accuracy")  # fmt: skip
            for _ in range(repeats):
                saved = [0, 0]  # checkpoints, bytes

                def keep(state, saved=saved) -> None:  # type: ignore[no-untyped-def]
                    path = folder / "state.npz"
                    weights = state.solver.weights
                    np.savez(path, solution=state.solver.solution, weights=np.zeros(0) if weights is None else weights)
                    saved[0], saved[1] = saved[0] + 1, saved[1] + path.stat().st_size

                start = time.perf_counter()
                job = run_solve(spec, model, x, y, None, k=K, heldout=HeldOutRows(xq, held), on_checkpoint=keep)
                job_wall = time.perf_counter() - start
                start = time.perf_counter()
                build = local_operators(model, spec)
                lib = solve_kernel(build(x, None), y, ridge=lam, options=solver_options(spec),
                                   heldout=HeldOut(build(xq, x), held))  # fmt: skip
                lib_wall = time.perf_counter() - start
                r = job.report
                print(f"  {solver} (progress_every {segment}): job {job_wall:.1f} s, {r.passes:.1f} passes, "
                      f"{r.iterations} steps, {saved[0]} checkpoints ({saved[1] / 2**20:.1f} MiB written), "
                      f"converged {r.converged}, held-out {r.heldout_curve[-1][1] if r.heldout_curve else '-'}; "
                      f"library {lib_wall:.1f} s, {lib.passes:.1f} passes, {lib.steps} steps; ratio "
                      f"{job_wall / lib_wall:.2f}, load {_load()}", flush=True)  # fmt: skip
