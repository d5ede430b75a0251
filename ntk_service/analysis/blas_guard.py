"""One BLAS thread for LAPACK calls on large matrices: the multithreaded OpenBLAS that numpy and scipy bundle crashes
the process there.

NOTE [large blas]
    numpy 2.4's and scipy 1.17's bundled OpenBLAS (0.3.31) segfault, with more than one thread, in Cholesky
    (``scipy.linalg.cho_factor``) of an n × n float64 matrix from n ≈ 16,000 (15,500 factors, 16,000 crashes, on
    this project's 2-core machine) and in ``g @ g.T`` with a 20,000-row result; with one BLAS thread the same calls
    run. A segfault takes the server down with every request in it, so the dense paths (the dense solver and GP
    solve through ``factor_solve``; the dense eigensolves, a precaution: no crash was seen in eigh) run their
    LAPACK calls under ``large_matrix_blas(n)``: one thread from ``LARGE_BLAS_ROWS`` rows, the pool untouched below
    (about 2x slower there on 2 cores, against a crash).
    tests/analysis/test_blas_guard.py factors a matrix past the limit in a subprocess.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from threadpoolctl import threadpool_limits

__all__ = ["LARGE_BLAS_ROWS", "large_matrix_blas"]

LARGE_BLAS_ROWS = 12_000
"""Rows from which LAPACK runs on one BLAS thread (NOTE [large blas]): below the smallest crash seen (16,000),
with a margin for other CPUs' thread partitions."""


@contextmanager
def large_matrix_blas(rows: int) -> Iterator[None]:
    """One BLAS thread inside the block when ``rows`` ≥ ``LARGE_BLAS_ROWS``, else nothing changes."""
    if rows < LARGE_BLAS_ROWS:
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield
