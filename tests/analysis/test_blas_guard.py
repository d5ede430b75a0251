"""NOTE [large blas]: the dense paths factor matrices past the size where the bundled multithreaded OpenBLAS
crashed the process (a Cholesky of 16,000 rows), and the guard leaves smaller work alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from threadpoolctl import threadpool_info

from ntk_service.analysis.blas_guard import LARGE_BLAS_ROWS, large_matrix_blas


def _blas_threads() -> list[int]:
    return [int(pool["num_threads"]) for pool in threadpool_info() if pool["user_api"] == "blas"]


def test_the_guard_takes_one_thread_only_past_the_limit_and_gives_the_pool_back() -> None:
    before = _blas_threads()
    with large_matrix_blas(LARGE_BLAS_ROWS - 1):
        assert _blas_threads() == before
    with large_matrix_blas(LARGE_BLAS_ROWS):
        assert _blas_threads() and set(_blas_threads()) == {1}
    assert _blas_threads() == before


def test_a_dense_solve_of_16000_rows_runs_and_is_right() -> None:
    # In a subprocess: without the guard this segfaulted (rc -11) on the 2-core machine, which would take the test
    # worker down with it. (2I + u uᵀ)⁻¹ b by Sherman–Morrison, written out, is the reference.
    script = textwrap.dedent(
        """
        import numpy as np
        from ntk_service.analysis.solve.dense import factor_solve
        n = 16_000
        rng = np.random.default_rng(0)
        u, b = rng.standard_normal(n), rng.standard_normal((n, 2))
        matrix = 2.0 * np.eye(n) + np.outer(u, u)
        solve, jitter, path, _ = factor_solve(matrix, None, with_lambda_min=False)
        expected = (b - np.outer(u, u @ b) / (2.0 + u @ u)) / 2.0
        error = np.abs(solve(b) - expected).max() / np.abs(expected).max()
        print(path, jitter, error)
        assert path == "cholesky" and jitter == 0.0 and error < 1e-10, (path, jitter, error)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"rc {run.returncode}: {run.stdout} {run.stderr[-2000:]}"
