"""What a Nyström preconditioner loses to its landmark sample: CG iterations on the dense scalar kernel.

The scalar kernel Θ_trace / k of the benchmark MLP 784-512-512-10 (benchmarks/_models.py) on N standard-normal
inputs, formed densely in float64, and the k target columns of a random teacher's centred one-hot labels; CG to
rtol 1e-5 on (Θ_s + λI) with the Frangella-Tropp-Udell preconditioner (NOTE [nystrom preconditioner]) built from:

- ``uniform m``: m uniformly sampled landmark columns, rank m (what ``shared_nystrom_preconditioner`` builds);
- ``4m -> m``: 4m landmark columns, the Nyström approximation truncated to its top m eigenpairs (the same basis
  memory as uniform m, four times the columns to compute);
- ``exact m``: the exact top m eigenvectors of Θ_s (``eigh``: the best any rank-m preconditioner can do).

Iterations depend only on the matrices, so the counts hold on a loaded machine; the script prints the spectrum's
shape (eigenvalue / λ at a few ranks) beside them.

    .venv/bin/python benchmarks/bench_nystrom_landmarks.py --n 8000            # ~5 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks._models import make_inputs, make_mlp  # noqa: E402
from ntk_service.kernels import compute_ntk  # noqa: E402

K = 10


def _labels(x: torch.Tensor, seed: int = 5) -> np.ndarray:
    teacher = torch.randn(x.shape[1], K, generator=torch.Generator().manual_seed(seed))
    return np.eye(K)[(x @ teacher).argmax(1).numpy()] - 0.1


def _pcg(a: np.ndarray, b: np.ndarray, apply: Callable[[np.ndarray], np.ndarray], rtol: float) -> int:
    """Iterations of preconditioned CG until every column's relative residual is ≤ rtol (columns batched)."""
    x, r = np.zeros_like(b), b.copy()
    z = apply(r)
    p, rz, nb = z.copy(), np.sum(r * z, 0), np.linalg.norm(b, axis=0)
    for i in range(5000):
        ap = a @ p
        alpha = rz / np.sum(p * ap, 0)
        x += alpha * p
        r -= alpha * ap
        if np.all(np.linalg.norm(r, axis=0) <= rtol * nb):
            return i + 1
        z = apply(r)
        rz_next = np.sum(r * z, 0)
        p = z + (rz_next / rz) * p
        rz = rz_next
    return 5000


def _preconditioner(u: np.ndarray, values: np.ndarray, lam: float) -> Callable[[np.ndarray], np.ndarray]:
    """P⁻¹ = (λ_r + λ) U (Λ + λI)⁻¹ Uᵀ + (I − U Uᵀ) for orthonormal U (n, r), Λ descending."""

    def apply(r: np.ndarray) -> np.ndarray:
        ur = u.T @ r
        out: np.ndarray = (values[-1] + lam) * (u @ (ur / (values[:, None] + lam))) + r - u @ ur
        return out

    return apply


def _nystrom(ks: np.ndarray, landmarks: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """The top ``rank`` eigenpairs of C W⁺ Cᵀ, C = Θ_s[:, landmarks], W = Θ_s[landmarks, landmarks]."""
    c, w = ks[:, landmarks], ks[np.ix_(landmarks, landmarks)]
    wv, wq = np.linalg.eigh(w)
    keep = wv > wv.max() * 1e-10
    f = c @ (wq[:, keep] / np.sqrt(wv[keep]))  # C W^{-1/2}: the approximation is f fᵀ
    g, q = np.linalg.eigh(f.T @ f)
    g, q = g[::-1][:rank], q[:, ::-1][:, :rank]
    return f @ (q / np.sqrt(np.maximum(g, 1e-300))), g


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--ridge", type=float, default=1e-3, help="λ relative to the mean diagonal")
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = args.n
    start = time.perf_counter()
    x = make_inputs("mlp", n)
    ks = compute_ntk(make_mlp(), x, mode="trace", dtype="float64").theta.numpy() / K
    b = _labels(x)
    lam = args.ridge * float(np.mean(np.diag(ks)))
    a = ks.copy()
    a[np.diag_indices_from(a)] += lam
    values, vectors = np.linalg.eigh(ks)
    values, vectors = values[::-1], vectors[:, ::-1]
    ranks = sorted({r for r in (1, 10, 100, 800, n // 4, n // 2, n) if r <= n})
    print(f"scalar kernel Θ_trace / k, MLP 784-512-512-10, N = {n}, ridge {args.ridge} × mean diagonal, rtol "
          f"{args.rtol}, load {' '.join(f'{v:.1f}' for v in os.getloadavg())}; built in "
          f"{time.perf_counter() - start:.0f} s")  # fmt: skip
    print("  eigenvalue / λ at ranks " + ", ".join(f"{r}: {values[r - 1] / lam:.0f}" for r in ranks))
    print(f"  no preconditioner: {_pcg(a, b, lambda r: r, args.rtol)} iterations")
    print(f"  {'m':>6} {'uniform m':>10} {'4m -> m':>8} {'exact m':>8}")
    order = np.random.default_rng(0).permutation(n)
    for m in (n // 100, n // 30, n // 10, n // 4):
        uniform = _pcg(a, b, _preconditioner(*_nystrom(ks, np.sort(order[:m]), m), lam), args.rtol)
        over = "-"
        if 4 * m <= n:
            over = str(_pcg(a, b, _preconditioner(*_nystrom(ks, np.sort(order[: 4 * m]), m), lam), args.rtol))
        exact = _pcg(a, b, _preconditioner(vectors[:, :m], values[:m], lam), args.rtol)
        print(f"  {m:>6} {uniform:>10} {over:>8} {exact:>8}", flush=True)


if __name__ == "__main__":
    main()
