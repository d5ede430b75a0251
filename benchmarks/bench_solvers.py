"""Solvers on the matrix-free operator and sketched features, against the dense kernel where it fits.

Sections (``--section``, default ``dense features``; ``scale`` only when asked):

- ``dense``: kernel ridge / GP mean on the benchmark MLP 784-512-512-10 (benchmarks/_models.py), dense
  (``compute_ntk`` + Cholesky) against preconditioned CG on ``ntk_operator`` (Nyström, m landmarks), side by side
  at each N: wall times, CG iterations, products and time per product, and the relative difference of the test
  predictions. The issue's sizes are N = 2000-8000 (``--n 2000 4000 8000 --mode trace``; FULL dense only fits to
  N ≈ 2000: its (N·k)² float64 matrix is 3.2 GB there).
- ``scale``: FULL kernel ridge on N MNIST-sized inputs (784 features, k = 10, a random teacher's one-hot labels)
  by preconditioned operator CG, the kernel never formed (it would be N²k² floats: 4 TB at N = 100,000 in
  float32... 8 TB in float64). Reports wall time, iterations, time per product, peak memory (VmHWM), and from the
  measured per-product time an estimate for ``--estimate-n`` (default 100,000) and for the TRACE solve there
  (k passes per product and k target columns: k² passes per iteration against 1).
  The default preconditioner is "streamed" (NOTE [streamed nystrom] in analysis/solve/streamed_nystrom.py:
  ``--shared-landmarks`` modes, default 1000, kept of ``--oversample`` × as many landmark examples, default 4,
  basis ``--basis-dtype``); "shared" is the uniform one (NOTE [shared nystrom]); several given run in turn on the
  same data (the iteration A/B). ``--max-minutes`` bounds each, build included, CG stopping with "time_limit".
- ``preconditioners``: the A/B of preconditioners by CG iterations on the dense FULL kernel at ``--n`` (the first),
  the streamed 4m -> m ones in both basis dtypes among them.
- ``block``: the A/B of ``CgOptions.method`` (block against batched CG) on the dense TRACE kernel at each ``--n``:
  kernel ridge with k = 10 target columns and a GP variance's ``--block-m`` columns, iterations and products.
- ``chunk``: the A/B of the operator's chunk size (``MAX_CHUNK_BYTES``), each configuration in its own process.
- ``ray``: s / product of ``ray_ntk_operator`` (``--shards`` one-thread Ray actors, default 2) against the
  in-process ``ntk_operator`` with ``--threads`` threads on the benchmark MLP at ``--ray-n`` (default 4000),
  alternated ``--products`` times in one process, the load average beside each pair.
- ``features``: ``ntk_features`` error against the exact FULL kernel by D on an N-subset, and the GP test mean with
  the feature kernel against the exact kernel's.
- ``sketch``: the A/B of ``ntk_features``' two sketches (``sketch="gaussian" | "structured"``) on the benchmark MLP
  at ``--sketch-n`` examples: seconds per call and the relative error of the FULL feature kernel at each D, the
  two alternated in one process (load average printed beside). A Gaussian D over ``--gaussian-max-dim`` (its D
  forward-mode products take minutes) is not run: its time is extrapolated from the largest D run (the cost is
  linear in D, by blocks of columns) and its error is Wick's expectation (NOTE [sketch error]), marked "est".
  ``--sketch-model cnn`` runs the benchmark CNN instead.

- ``auto``, ``solve``, ``trace``, ``ray-solve``, ``ridge``, ``job``: the solver table (``solve_kernel``; issue 38's
  cases, benchmarks/_solve_cases.py has each): auto against scipy's Cholesky where dense fits (``--n``), the FULL
  solve at ``--scale-n`` with ``--heldout`` examples by each of ``--solvers``, a TRACE solve, the solve on Ray
  against one process, ``estimate_ridge`` against held-out accuracy, and the solve job's path (``run_solve`` with
  its checkpoints on disk) against ``solve_kernel``, alternated, pcg at each ``--progress-every``.

    .venv/bin/python benchmarks/bench_solvers.py --n 200 400 --features-n 100          # a small run: seconds
    .venv/bin/python benchmarks/bench_solvers.py --section auto --n 2000 --repeats 2
    .venv/bin/python benchmarks/bench_solvers.py --section job --scale-n 20000 --heldout 2000 --solvers pcg block
    .venv/bin/python benchmarks/bench_solvers.py --section solve --scale-n 100000 --solvers auto block --max-minutes 10
    .venv/bin/python benchmarks/bench_solvers.py --section dense --mode trace --n 2000 4000 8000
    .venv/bin/python benchmarks/bench_solvers.py --section scale --scale-n 100000 --max-minutes 45 --scale-rtol 3e-5
    .venv/bin/python benchmarks/bench_solvers.py --section ray --ray-n 4000 --products 5
    .venv/bin/python benchmarks/bench_solvers.py --section sketch --sketch-dims 256 1024 4096        # ~2.5 min
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import scipy.linalg  # noqa: E402
import torch  # noqa: E402

from benchmarks._models import make_cnn, make_inputs, make_mlp  # noqa: E402
from benchmarks._solve_cases import (  # noqa: E402
    section_auto,
    section_job,
    section_ray_solve,
    section_ridge,
    section_solve,
    section_trace,
)
from ntk_service.analysis import CgOptions, gp_inference  # noqa: E402
from ntk_service.analysis.solve import (  # noqa: E402
    conjugate_gradients,
    kernel_operator,
    nystrom_preconditioner,
    shared_nystrom_preconditioner,
    streamed_nystrom_preconditioner,
)
from ntk_service.jobs.executors import import_ray, ray_ntk_operator  # noqa: E402
from ntk_service.kernels import compute_ntk, feature_kernel, ntk_features, ntk_operator  # noqa: E402

K = 10

SOLVE_SECTIONS = ["auto", "solve", "trace", "ray-solve", "ridge", "job"]
"""The solver table's sections (benchmarks/_solve_cases.py: issue 38's "What must be shown" 1-5)."""


def _peak_mib() -> float:
    """This process's own peak RSS (VmHWM; ru_maxrss would carry a parent's peak, DESIGN §6)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _labels(x: torch.Tensor, seed: int = 5) -> np.ndarray:
    """One-hot labels of a fixed random linear teacher (a learnable rule, like class labels)."""
    teacher = torch.randn(x.shape[1], K, generator=torch.Generator().manual_seed(seed))
    classes = (x @ teacher).argmax(1)
    return np.eye(K)[classes.numpy()] - 0.1  # centred one-hot


def _matrix(theta: torch.Tensor, mode: str) -> np.ndarray:
    if mode == "trace":
        return theta.double().numpy() / K  # read as (trace / k) ⊗ I_k (NOTE [layout])
    n, m = theta.shape[:2]
    return theta.double().permute(0, 2, 1, 3).reshape(n * K, m * K).numpy()


def section_dense(ns: list[int], mode: str, ridge: float, landmarks: int, rtol: float) -> None:
    model = make_mlp()
    print(f"dense vs CG, MLP 784-512-512-10, {mode}, ridge {ridge} (relative to the mean diagonal), rtol {rtol}")
    print(f"{'N':>6} {'dense s':>9} {'(kernel':>8} {'chol)':>7} {'CG s':>8} {'iters':>6} {'products':>8} "
          f"{'s/product':>10} {'rel diff':>9} {'CG/dense':>9}")  # fmt: skip
    for n in ns:
        x = make_inputs("mlp", n + 200)
        x_train, x_test = x[:n], x[n:]
        y = _labels(x_train)
        start = time.perf_counter()
        a = _matrix(compute_ntk(model, x_train, mode=mode, dtype="float64").theta, mode)
        c = _matrix(compute_ntk(model, x_test, x_train, mode=mode, dtype="float64").theta, mode)
        kernel_s = time.perf_counter() - start
        lam = ridge * float(np.mean(np.diag(a)))
        start = time.perf_counter()
        factor = scipy.linalg.cho_factor(a + lam * np.eye(a.shape[0]), lower=True)
        dense = c @ scipy.linalg.cho_solve(factor, y.reshape(-1) if mode == "full" else y)
        chol_s = time.perf_counter() - start
        train_op = ntk_operator(model, x_train, mode=mode, dtype="float64")
        cross_op = ntk_operator(model, x_test, x_train, mode=mode, dtype="float64")
        for label, pre in ((f"nystrom m={landmarks}", "nystrom"), ("no preconditioner", "none")):  # the A/B
            start = time.perf_counter()
            options = CgOptions(rtol=rtol, landmarks=landmarks, preconditioner=pre)  # type: ignore[arg-type]
            post = gp_inference(train_op, y, cross_op, ridge=lam, cg=options)
            cg_s = time.perf_counter() - start
            solve = post.solve
            assert solve is not None
            diff = float(np.linalg.norm(post.mean.reshape(-1) - dense.reshape(-1)) / np.linalg.norm(dense))
            per = cg_s / max(solve.products, 1)
            note = "" if solve.converged else f"  NOT CONVERGED ({solve.stop_reason})"
            dense_s = kernel_s + chol_s
            print(f"{n:>6} {dense_s:>9.2f} {kernel_s:>8.2f} {chol_s:>7.2f} {cg_s:>8.2f} {solve.iterations:>6} "
                  f"{solve.products:>8} {per:>10.4f} {diff:>9.2e} {cg_s / dense_s:>9.2f}  {label}{note}")  # fmt: skip


def section_scale(
    n: int,
    ridge: float,
    landmarks: int,
    rtol: float,
    estimate_n: int,
    max_iterations: int,
    preconditioners: list[str],
    max_minutes: float | None,
    shared_landmarks: int,
    oversample: float,
    basis_dtype: str,
) -> None:
    """FULL kernel ridge on N examples by operator CG, once per entry of ``preconditioners`` (in this process, on
    the same data: iteration counts are the A/B, load-independent; walls are not). "streamed" (the default) is
    ``streamed_nystrom_preconditioner`` (NOTE [streamed nystrom]): ``shared_landmarks`` modes kept of
    round(``oversample``·m) landmark examples, trace columns streamed in row chunks, basis ``basis_dtype``;
    "shared" is the PR-before path, m uniform landmark examples, their (N, m) trace columns held whole (NOTE
    [shared nystrom]); "nystrom" spends ``landmarks`` products on FULL columns. ``max_minutes`` bounds each
    configuration, build included."""
    model = make_mlp()
    x = make_inputs("mlp", n + 1000)
    x_train, x_test = x[:n], x[n:]
    y = _labels(x_train)
    train_op = ntk_operator(model, x_train)  # float32 products, float64 CG (NOTE [cg]); chunks ≤ MAX_CHUNK_BYTES
    cross_op = ntk_operator(model, x_test, x_train)
    # λ relative to the mean diagonal, from 64 examples' exact diagonal (the operator does not know it)
    diag = compute_ntk(model, x_train[:64], mode="example_diagonal").theta.diagonal(dim1=1, dim2=2).mean()
    lam = ridge * float(diag)
    print(f"FULL kernel ridge by operator CG, MLP 784-512-512-10, N = {n} (kernel never formed: "
          f"{(n * K) ** 2 * 4 / 1e12:.3g} TB in float32), chunk {train_op.examples_per_chunk} examples, rtol {rtol}, "
          f"load {' '.join(f'{v:.1f}' for v in os.getloadavg())}")  # fmt: skip
    for preconditioner in preconditioners:
        start = time.perf_counter()
        build_s, pre = 0.0, preconditioner  # type: ignore[assignment]
        if preconditioner == "shared":
            chosen = np.sort(np.random.default_rng(0).choice(n, size=min(shared_landmarks, n), replace=False))
            # float64 columns written chunk by chunk: compute_ntk's workspace is one chunk's, and no float32 copy
            # of the whole (N, m) block lives beside the float64 one
            columns = np.empty((n, chosen.size))
            for i in range(0, n, 10_000):
                block = compute_ntk(model, x_train[i : i + 10_000], x_train[chosen], mode="trace").theta
                columns[i : i + 10_000] = block.double().numpy()
            pre = shared_nystrom_preconditioner(
                kernel_operator(train_op, k=K, name="train", operation="bench"),
                ridge=lam,
                trace_columns=columns,
                landmark_indices=chosen,
            )
            del columns
            build_s = time.perf_counter() - start
        elif preconditioner == "streamed":
            pre = streamed_nystrom_preconditioner(
                model,
                x_train,
                ridge=lam,
                outputs=K,
                landmarks=min(shared_landmarks, n),
                oversample=oversample,
                basis_dtype=basis_dtype,
            )
            build_s = pre.build_seconds  # type: ignore[attr-defined]
        options = CgOptions(
            rtol=rtol,
            landmarks=landmarks,
            max_iterations=max_iterations,
            preconditioner=pre,  # type: ignore[arg-type]
            max_seconds=None if max_minutes is None else max(1.0, max_minutes * 60 - (time.perf_counter() - start)),
        )
        post = gp_inference(train_op, y, cross_op, ridge=lam, cg=options)
        wall = time.perf_counter() - start
        solve = post.solve
        assert solve is not None
        per = solve.time_s / max(solve.products, 1)  # the preconditioner's build is timed apart (build_s)
        accuracy = float(np.mean(post.mean.argmax(1) == _labels(x_test).argmax(1)))
        verdict = "converged" if solve.converged else f"NOT CONVERGED ({solve.stop_reason})"
        print(f"  {solve.preconditioner}: wall {wall:.1f} s, iterations {solve.iterations}, products "
              f"{solve.products} (preconditioner built in {build_s:.1f} s), {per:.3f} s/product, "
              f"residual {solve.residual.max():.2e}, {verdict}, peak {_peak_mib():.0f} MiB, "
              f"test accuracy {accuracy:.3f}, load {' '.join(f'{v:.1f}' for v in os.getloadavg())}")  # fmt: skip
        product_s = solve.products * per
        print(f"  limited by: products {product_s:.0f} s ({100 * product_s / wall:.0f} % of the wall; each a VJP "
              f"and a JVP over all N examples), preconditioner build {build_s:.0f} s, the rest (CG vectors, the "
              f"preconditioner's applications, the test predictions) {wall - product_s - build_s:.0f} s")  # fmt: skip
        scale = estimate_n / n
        est = solve.products * per * scale
        print(f"  estimate at N = {estimate_n}: {per * scale:.2f} s/product (linear in N) × {solve.products} "
              f"products (this run's count; iterations grow with N at a fixed ridge) = {est / 60:.1f} min; TRACE "
              f"there: {K}× the passes per product and {K} target columns = {K * K}× per iteration: "
              f"≈ {est * K * K / 3600:.1f} h for the same iteration count", flush=True)  # fmt: skip


class _BlockJacobi:
    """(A + λI)'s per-example k × k diagonal blocks, inverted: the block-Jacobi preconditioner of the A/B."""

    name = "block-jacobi"

    def __init__(self, a: np.ndarray, lam: float, n: int) -> None:
        blocks = np.stack([a[i * K : (i + 1) * K, i * K : (i + 1) * K] for i in range(n)]) + lam * np.eye(K)
        self.inverse, self.n = np.linalg.inv(blocks), n

    def apply(self, r: np.ndarray) -> np.ndarray:
        out: np.ndarray = np.einsum("nab,nbc->nac", self.inverse, r.reshape(self.n, K, -1)).reshape(r.shape)
        return out


def section_preconditioners(n: int, ridge: float, rtol: float) -> None:
    """The preconditioners A/B'd by CG iterations on the dense FULL kernel at a small N (iterations depend only on
    the matrix, so a dense product stands in for the operator's; products to build each are listed apart)."""
    model = make_mlp()
    x = make_inputs("mlp", n)
    theta = compute_ntk(model, x, mode="full", dtype="float64").theta
    a = theta.permute(0, 2, 1, 3).reshape(n * K, n * K).numpy()
    trace = np.einsum("nmaa->nm", theta.numpy())
    y = _labels(x).reshape(-1, 1)
    lam = ridge * float(np.mean(np.diag(a)))
    op = kernel_operator(theta, k=K, name="theta", operation="bench")
    print(f"CG iterations to rtol {rtol}, dense FULL kernel of the MLP 784-512-512-10, N = {n} (n = {n * K}), "
          f"ridge {ridge} × mean diagonal")  # fmt: skip
    rng = np.random.default_rng(0)
    shared = {}
    for m in (n // 20, n // 10, 100, 300, 1000):
        if m <= n:
            chosen = np.sort(rng.choice(n, size=m, replace=False))
            pre = shared_nystrom_preconditioner(op, ridge=lam, trace_columns=trace[:, chosen], landmark_indices=chosen)
            shared[f"shared, m = {m} examples (one compute_ntk trace call)"] = pre
            if 4 * m <= n:  # NOTE [streamed nystrom]: 4m landmark examples, top m modes, in both basis dtypes
                for dtype in ("float64", "float32"):
                    shared[f"streamed, 4m -> m = {m}, {dtype} basis"] = streamed_nystrom_preconditioner(
                        model, x, ridge=lam, outputs=K, landmarks=m, basis_dtype=dtype, dtype="float64"
                    )
    options: dict[str, object] = {"none": "none", "block-Jacobi (k backward passes)": _BlockJacobi(a, lam, n)}
    for m in (100, 300):
        options[f"Nyström uniform, m = {m} (m products)"] = nystrom_preconditioner(op, ridge=lam, landmarks=m)
        options[f"Nyström gaussian, m = {m} (m products)"] = nystrom_preconditioner(
            op, ridge=lam, landmarks=m, method="gaussian"
        )
    for label, pre in {**options, **shared}.items():
        cg = CgOptions(rtol=rtol, preconditioner=pre, max_iterations=3000)  # type: ignore[arg-type]
        result = conjugate_gradients(op, y, ridge=lam, options=cg)
        print(f"  {label:<48} {result.iterations:>5} iterations  converged {result.converged}")


def section_block(ns: list[int], m: int, ridge: float, rtol: float, repeats: int) -> None:
    """The A/B of ``CgOptions.method`` (NOTE [cg method]): block against batched CG, alternated in this process,
    on the dense TRACE kernel of the benchmark MLP (products cost the same in both, so the count is the measure
    and the wall the check): kernel ridge with its k = 10 target columns, and the GP variance's m columns
    Θ(x, x*) / k. Iterations and products do not depend on the load; walls do (printed beside)."""
    model = make_mlp()
    print(f"block vs batched CG, dense TRACE kernel (read as trace / k), MLP 784-512-512-10, ridge {ridge} × mean "
          f"diagonal, rtol {rtol}, {repeats} alternations")  # fmt: skip
    print(f"{'N':>6} {'solve':>14} {'pre':>10} {'method':>8} {'iters':>6} {'products':>9} {'wall s':>8} "
          f"{'max resid':>10} {'load':>16}")  # fmt: skip
    for n in ns:
        x = make_inputs("mlp", n + m)
        theta = compute_ntk(model, x, mode="trace", dtype="float64").theta.numpy() / K
        a, cross = theta[:n, :n], theta[:n, n:]  # cross: Θ(x, x*) / k, the variance's right-hand sides
        lam = ridge * float(np.mean(np.diag(a)))
        op = kernel_operator(a, k=1, name="a", operation="bench")
        cases = {"ridge k=10": _labels(x[:n]), f"variance m={m}": cross}
        for label, rhs in cases.items():
            for pre in ("none", "nystrom"):
                runs: dict[str, list] = {"block": [], "batched": []}
                for _ in range(repeats):
                    for method in runs:
                        options = CgOptions(rtol=rtol, preconditioner=pre, method=method)  # type: ignore[arg-type]
                        start = time.perf_counter()
                        result = conjugate_gradients(op, rhs, ridge=lam, options=options)
                        runs[method].append((time.perf_counter() - start, result))
                for method, timed in runs.items():
                    wall = float(np.median([t for t, _ in timed]))
                    result = timed[0][1]
                    load = " ".join(f"{v:.1f}" for v in os.getloadavg())
                    print(f"{n:>6} {label:>14} {pre:>10} {method:>8} {result.iterations:>6} {result.products:>9} "
                          f"{wall:>8.3f} {result.residual.max():>10.1e} {load:>16}"
                          f"{'' if result.converged else '  NOT CONVERGED'}")  # fmt: skip


def _chunk_one(n: int, chunk: int, products: int) -> None:
    """One configuration in a process of its own (VmHWM only grows): s / product and the peak."""
    model = make_mlp()
    x = make_inputs("mlp", n)
    op = ntk_operator(model, x, examples_per_chunk=chunk if chunk > 0 else n)
    v = torch.randn(n, K, generator=torch.Generator().manual_seed(0))
    op.matvec(v)  # warm-up
    start = time.perf_counter()
    for _ in range(products):
        op.matvec(v)
    print(f"{n:>7} {op.examples_per_chunk:>7} {(time.perf_counter() - start) / products:>10.3f} {_peak_mib():>9.0f}")


def section_chunk(n: int, chunks: list[int], products: int) -> None:
    """The A/B of ``MAX_EXAMPLES_PER_CHUNK``: the same FULL product with all N examples in one VJP / JVP against
    bounded chunks, each configuration in its own process (alternated twice), s / product and peak RSS."""
    print(f"FULL product, MLP 784-512-512-10, N = {n}, {products} products per process (0 = all N in one chunk)")
    print(f"{'N':>7} {'chunk':>7} {'s/product':>10} {'peak MiB':>9}")
    for _ in range(2):
        for chunk in chunks:
            command = [sys.executable, __file__, "--chunk-one", str(chunk), "--scale-n", str(n)]
            subprocess.run([*command, "--products", str(products)], check=True)


def section_ray(n: int, shards: int, products: int, mode: str) -> None:
    """The in-process operator (``--threads`` threads) against ``shards`` one-thread Ray actors: the same product,
    alternated in one process (each runs while the other idles), s / product, the ratio and the load."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray = import_ray()
    ray.init(num_cpus=shards, include_dashboard=False, log_to_driver=False)
    model = make_mlp()
    x = make_inputs("mlp", n)
    local = ntk_operator(model, x, mode=mode)
    start = time.perf_counter()
    sharded = ray_ntk_operator(model, x, shards=shards, mode=mode, num_cpus=1)
    build_s = time.perf_counter() - start
    shape = (n, K) if mode == "full" else (n,)
    v = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    diff = float((sharded.matvec(v) - local.matvec(v)).norm() / local.matvec(v).norm())  # and the warm-up
    print(f"Θ v, {mode}, MLP 784-512-512-10, N = {n}: in-process ntk_operator ({torch.get_num_threads()} threads, "
          f"chunk {local.examples_per_chunk}) vs ray_ntk_operator ({sharded.shards} one-thread actors; built in "
          f"{build_s:.1f} s); relative difference {diff:.1e} (float32)")  # fmt: skip
    print(f"{'round':>5} {'local s':>8} {'ray s':>8} {'ray/local':>10}  load (1, 5, 15 min)")
    ratios = []
    for r in range(products):
        start = time.perf_counter()
        local.matvec(v)
        local_s = time.perf_counter() - start
        start = time.perf_counter()
        sharded.matvec(v)
        ray_s = time.perf_counter() - start
        ratios.append(ray_s / local_s)
        load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
        print(f"{r:>5} {local_s:>8.3f} {ray_s:>8.3f} {ray_s / local_s:>10.2f}  {load}")
    print(f"median ray/local {float(np.median(ratios)):.2f}")
    sharded.close()
    ray.shutdown()


def section_features(n: int, dims: list[int], seeds: int, ridge: float) -> None:
    model = make_mlp()
    x = make_inputs("mlp", n + 50)
    x_train, x_test = x[:n], x[n:]
    y = _labels(x_train)
    start = time.perf_counter()
    exact = compute_ntk(model, x_train, mode="full", dtype="float64").theta
    exact_test = compute_ntk(model, x_test, x_train, mode="full", dtype="float64").theta
    exact_s = time.perf_counter() - start
    lam = ridge * float(exact.diagonal(dim1=2, dim2=3).mean())
    exact_mean = gp_inference(exact, y, exact_test, ridge=lam).mean
    truth = _labels(x_test)
    print(f"features vs exact FULL kernel, MLP 784-512-512-10, N = {n} (+50 test), exact kernels {exact_s:.1f} s, "
          f"GP ridge {ridge:g} × mean diagonal; exact GP test MSE "
          f"{np.mean((exact_mean - truth) ** 2):.4f}")  # fmt: skip
    print(f"{'D':>6} {'rel err':>9} {'×√D':>7} {'GP mean diff':>13} {'GP MSE':>8} {'s/call':>8}")
    norm = float(exact.norm())
    for d in dims:
        errs, diffs, mses, secs = [], [], [], []
        for s in range(seeds):
            start = time.perf_counter()
            phi = ntk_features(model, torch.cat([x_train, x_test]), dim=d, seed=s, dtype="float64")
            secs.append(time.perf_counter() - start)
            phi_train, phi_test = phi[:n], phi[n:]
            errs.append(float((feature_kernel(phi_train) - exact).norm()) / norm)
            mean = gp_inference(feature_kernel(phi_train), y, feature_kernel(phi_test, phi_train), ridge=lam).mean
            diffs.append(float(np.linalg.norm(mean - exact_mean) / np.linalg.norm(exact_mean)))
            mses.append(float(np.mean((mean - truth) ** 2)))
        err = float(np.mean(errs))
        print(f"{d:>6} {err:>9.4f} {err * d**0.5:>7.2f} {np.mean(diffs):>13.4f} {np.mean(mses):>8.4f} "
              f"{np.median(secs):>8.2f}")  # fmt: skip


def section_sketch(n: int, dims: list[int], seeds: int, gaussian_max_dim: int, name: str) -> None:
    model = make_mlp() if name == "mlp" else make_cnn()
    x = make_inputs(name, n)
    exact = compute_ntk(model, x, mode="full", dtype="float64").theta
    norm = float(exact.norm())
    # Wick's expectation for the Gaussian sketch: E‖ΦΦᵀ − Θ‖²_F = (‖Θ‖²_F + (tr Θ)²) / D (NOTE [sketch error])
    wick = (norm**2 + float(torch.einsum("nnaa->", exact)) ** 2) ** 0.5 / norm
    label = "MLP 784-512-512-10" if name == "mlp" else "CNN conv 3->32, conv/2 32->32, Linear 6272->10"
    print(f"sketches, {label}, N = {n}, float32, FULL feature kernel against the exact float64 kernel; "
          f"rms relative error over {seeds} seeds (Gaussian expectation {wick:.2f}/√D)")  # fmt: skip
    print(f"{'D':>6} {'sketch':>11} {'s/call':>8} {'rel err':>8} {'×√D':>6}  load")
    per_column = 0.0
    for d in dims:
        runs: dict[str, tuple[list[float], list[float]]] = {"structured": ([], []), "gaussian": ([], [])}
        for s in range(seeds):
            for sketch, (secs, errs) in runs.items():  # alternated: both see the same load
                if sketch == "gaussian" and d > gaussian_max_dim:
                    continue
                start = time.perf_counter()
                phi = ntk_features(model, x, dim=d, seed=s, sketch=sketch)
                secs.append(time.perf_counter() - start)
                errs.append(float((feature_kernel(phi.double()) - exact).norm()) / norm)
        for sketch, (secs, errs) in runs.items():
            if secs:
                sec, err, mark = float(np.median(secs)), float(np.sqrt(np.mean(np.square(errs)))), ""
                if sketch == "gaussian":
                    per_column = sec / d
            else:
                sec, err, mark = per_column * d, wick / d**0.5, " est"
            load = " ".join(f"{v:.1f}" for v in os.getloadavg())
            print(f"{d:>6} {sketch:>11} {sec:>8.2f} {err:>8.4f} {err * d**0.5:>6.2f}  {load}{mark}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sections = ["dense", "scale", "features", "chunk", "preconditioners", "ray", "block", "sketch", *SOLVE_SECTIONS]
    parser.add_argument("--section", nargs="+", default=["dense", "features"], choices=sections)
    parser.add_argument("--n", type=int, nargs="+", default=[200, 400])
    parser.add_argument("--mode", default="full", choices=["full", "trace"])
    parser.add_argument("--ridge", type=float, default=1e-3, help="λ relative to the mean diagonal entry")
    parser.add_argument("--landmarks", type=int, default=100, help="FULL columns of --preconditioner nystrom")
    parser.add_argument(
        "--shared-landmarks", type=int, default=1000, help="modes m of --preconditioner shared / streamed"
    )
    parser.add_argument(
        "--preconditioner",
        nargs="+",
        default=["streamed"],
        choices=["auto", "none", "nystrom", "shared", "streamed"],
        help="--section scale: each in turn on the same data",
    )
    parser.add_argument("--oversample", type=float, default=4.0, help="--preconditioner streamed: s = oversample·m")
    parser.add_argument("--basis-dtype", default="float64", choices=["float64", "float32"], help="streamed basis")
    parser.add_argument("--max-minutes", type=float, default=None, help="--section scale: stop CG (reported)")
    parser.add_argument("--rtol", type=float, default=1e-8)
    parser.add_argument("--scale-n", type=int, default=2000)
    parser.add_argument("--scale-rtol", type=float, default=1e-5)
    parser.add_argument("--max-iterations", type=int, default=1000)
    parser.add_argument("--estimate-n", type=int, default=100_000)
    parser.add_argument("--features-n", type=int, default=100)
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--sketch-n", type=int, default=200)
    parser.add_argument("--sketch-dims", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--sketch-seeds", type=int, default=2)
    parser.add_argument("--sketch-model", default="mlp", choices=["mlp", "cnn"], help="benchmarks/_models.py")
    parser.add_argument("--gaussian-max-dim", type=int, default=1024, help="--section sketch: larger D estimated")
    parser.add_argument("--features-ridge", type=float, default=1e-3, help="GP ridge × mean diagonal (features)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 1024, 256], help="--section chunk")
    parser.add_argument("--products", type=int, default=3, help="--section chunk and ray")
    parser.add_argument("--ray-n", type=int, default=4000, help="--section ray")
    parser.add_argument("--shards", type=int, default=2, help="--section ray: one-thread actors")
    parser.add_argument(
        "--ray-iterations", type=int, default=None, help="--section ray-solve: this many CG iterations each way"
    )
    parser.add_argument("--block-m", type=int, default=200, help="--section block: the variance's test points")
    parser.add_argument("--repeats", type=int, default=2, help="--section block: alternations")
    parser.add_argument("--chunk-one", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--heldout", type=int, default=10_000, help="--section solve / ridge: held-out examples")
    parser.add_argument("--solvers", nargs="+", default=["auto"], help="--section solve / job: each in turn")
    parser.add_argument(
        "--progress-every", type=int, nargs="+", default=[200, 10**9], help="--section job: pcg's checkpoint spacing"
    )
    parser.add_argument("--solve-rtol", type=float, default=1e-3, help="--section solve / ray-solve")
    parser.add_argument("--reference-rtol", type=float, default=None, help="--section solve: a float64 reference")
    parser.add_argument("--ridges", type=float, nargs="+", default=[1e-4, 1e-3, 1e-2], help="--section ridge")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.chunk_one is not None:
        _chunk_one(args.scale_n, args.chunk_one, args.products)
        return
    if "preconditioners" in args.section:
        section_preconditioners(args.n[0], args.ridge, args.scale_rtol)
    if "block" in args.section:
        section_block(args.n, args.block_m, args.ridge, args.rtol, args.repeats)
    if "chunk" in args.section:
        section_chunk(args.scale_n, args.chunks, args.products)
    if "dense" in args.section:
        section_dense(args.n, args.mode, args.ridge, args.landmarks, args.rtol)
    if "scale" in args.section:
        section_scale(
            args.scale_n,
            args.ridge,
            args.landmarks,
            args.scale_rtol,
            args.estimate_n,
            args.max_iterations,
            args.preconditioner,
            args.max_minutes,
            args.shared_landmarks,
            args.oversample,
            args.basis_dtype,
        )
    if "ray" in args.section:
        section_ray(args.ray_n, args.shards, args.products, args.mode)
    if "features" in args.section:
        section_features(args.features_n, args.dims, args.seeds, args.features_ridge)
    if "sketch" in args.section:
        section_sketch(args.sketch_n, args.sketch_dims, args.sketch_seeds, args.gaussian_max_dim, args.sketch_model)
    if "auto" in args.section:
        section_auto(args.n[0], args.repeats)
    if "solve" in args.section:
        section_solve(args.scale_n, args.heldout, args.solvers, args.solve_rtol, args.ridge, args.max_minutes,
                      args.reference_rtol)  # fmt: skip
    if "trace" in args.section:
        section_trace(args.scale_n, 10.0 if args.max_minutes is None else args.max_minutes, args.ridge)
    if "ray-solve" in args.section:
        section_ray_solve(args.ray_n, args.shards, args.solve_rtol, args.solvers[0], args.ray_iterations)
    if "ridge" in args.section:
        section_ridge(args.scale_n, args.heldout, args.ridges)
    if "job" in args.section:
        section_job(args.scale_n, args.heldout, args.solvers, args.solve_rtol, args.ridge, args.repeats,
                    args.progress_every)  # fmt: skip


if __name__ == "__main__":
    main()
