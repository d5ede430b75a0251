"""Sketched NTK features against the exact kernel at N = 2000 (issue 26, benchmark 3).

MLP 784-512-512-10 (``_models.make_mlp``), FULL kernel. The exact kernel Θ (N·k × N·k, float64, 3.2 GB at
N = 2000) is computed once by ``compute_ntk`` in row blocks into a ``.npy`` file under ``--cache`` and reused by
every D and every later run. Per D (structured sketch by default, float32 Φ as the model): the FULL relative error
‖ΦΦᵀ − Θ‖_F / ‖Θ‖_F (formed in row blocks, never the whole ΦΦᵀ), the same × √D, the TRACE kernel's relative
error, and the GP test mean with the feature kernel against the exact one (MSE and accuracy) at each ridge.

Targets are learnable: a 10-class Gaussian mixture, x = z + μ_c with z standard normal (``make_inputs``) and class
means μ_c ~ N(0, s² I) (``--separation`` s), labels one-hot. The exact GP's test MSE is clearly below the labels'
variance (0.09), so the MSE column measures accuracy lost to the sketch, not noise.

GP means: exact by scipy ``cho_factor`` / ``cho_solve`` on the dense Θ + λI (N·k = 20,000 rows); with features in
feature space by the push-through identity Φ_t Φᵀ (ΦΦᵀ + λI)⁻¹ y = Φ_t (ΦᵀΦ + λI)⁻¹ Φᵀ y, a D × D solve (float64),
the same mean as the dense kernel ΦΦᵀ would give. λ = ridge × the mean diagonal of the exact Θ, for both.

    .venv/bin/python benchmarks/bench_features.py --dims 256 1024 4096 16384 --seeds 2 --seed-max-dim 1024

Peak memory ~ the exact test kernel (0.8 GB), one exact factorization (3.2 GB) or Φ (float32, 4·N_all·k·D bytes)
plus the D × D system (8·D² bytes); the exact kernel's pages are read from the memory-mapped cache file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import scipy.linalg  # noqa: E402
import torch  # noqa: E402

from benchmarks._models import make_inputs, make_mlp  # noqa: E402
from ntk_service.kernels import compute_ntk, ntk_features  # noqa: E402

K = 10
ROW_BLOCK = 250
"""Examples per ``compute_ntk`` call for the exact kernel: (250, N, k, k) float64 is 0.4 GB at N = 2000."""


def _load() -> str:
    return " ".join(f"{v:.1f}" for v in os.getloadavg())


def _peak_mib() -> float:
    """This process's own peak RSS (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def mixture(n: int, separation: float, seed: int = 7) -> tuple[torch.Tensor, np.ndarray]:
    """n inputs x = z + μ_c of a 10-class Gaussian mixture and their classes c (n,)."""
    rng = np.random.default_rng(seed)
    means = rng.standard_normal((K, 784)) * separation
    classes = rng.integers(0, K, n)
    x = make_inputs("mlp", n) + torch.from_numpy(means[classes]).float()
    return x, classes


def _flat(theta: torch.Tensor) -> np.ndarray:
    """(n, m, k, k) -> (n·k, m·k), row n·k + a: the layout of Φ (N, k, D) reshaped to (N·k, D)."""
    n, m = theta.shape[0], theta.shape[1]
    return theta.permute(0, 2, 1, 3).reshape(n * K, m * K).numpy()


def exact_kernels(
    x_train: torch.Tensor, x_test: torch.Tensor, cache: Path
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Θ(train, train) (memory-mapped, N·k × N·k), Θ(test, train) (M·k × N·k) and the TRACE Θ (N × N)."""
    model = make_mlp()
    n = x_train.shape[0]
    cache.mkdir(parents=True, exist_ok=True)
    train_path, test_path, trace_path = cache / "theta_train.npy", cache / "theta_test.npy", cache / "trace.npy"
    if not (train_path.exists() and test_path.exists() and trace_path.exists()):
        start = time.perf_counter()
        out = np.lib.format.open_memmap(train_path.with_suffix(".part"), "w+", np.float64, (n * K, n * K))
        trace = np.empty((n, n))
        for i in range(0, n, ROW_BLOCK):
            theta = compute_ntk(model, x_train[i : i + ROW_BLOCK], x_train, mode="full", dtype="float64").theta
            out[i * K : (i + ROW_BLOCK) * K] = _flat(theta)
            trace[i : i + ROW_BLOCK] = theta.diagonal(dim1=2, dim2=3).sum(-1).numpy()
            print(f"  exact rows {i + ROW_BLOCK}/{n}: {time.perf_counter() - start:.0f} s", flush=True)
        out.flush()
        del out
        test = compute_ntk(model, x_test, x_train, mode="full", dtype="float64").theta
        np.save(test_path, _flat(test))
        np.save(trace_path, trace)
        train_path.with_suffix(".part").rename(train_path)
        print(f"exact kernels: {time.perf_counter() - start:.0f} s (load {_load()})", flush=True)
    return np.load(train_path, mmap_mode="r"), np.load(test_path), np.load(trace_path)


def exact_gp(theta_path: Path, theta_test: np.ndarray, y: np.ndarray, lam: float) -> np.ndarray:
    """The exact GP test mean Θ_t (Θ + λI)⁻¹ y by Cholesky; one copy of Θ in memory, factored in place."""
    a = np.load(theta_path)
    a[np.diag_indices_from(a)] += lam
    # a.T: the same symmetric matrix, Fortran-ordered, so LAPACK factors it in place instead of copying 3.2 GB
    factor = scipy.linalg.cho_factor(a.T, overwrite_a=True, check_finite=False)
    alpha = scipy.linalg.cho_solve(factor, y, check_finite=False)
    del a, factor
    return theta_test @ alpha


def trace_gp(kernel: np.ndarray, kernel_test: np.ndarray, y: np.ndarray, lam: float) -> np.ndarray:
    """The GP mean K_t (K + λI)⁻¹ Y of the TRACE kernel K (N × N), one scalar kernel for the k outputs Y (N, k)."""
    a = kernel.copy()
    a[np.diag_indices_from(a)] += lam
    return kernel_test @ scipy.linalg.cho_solve(scipy.linalg.cho_factor(a, check_finite=False), y)


def feature_gp(phi: np.ndarray, phi_test: np.ndarray, y: np.ndarray, lams: list[float]) -> list[np.ndarray]:
    """Φ_t (ΦᵀΦ + λI)⁻¹ Φᵀ y (= the dense feature kernel's GP mean) per λ; ΦᵀΦ summed in float64."""
    d = phi.shape[1]
    gram, rhs = np.zeros((d, d)), np.zeros(d)
    for i in range(0, phi.shape[0], 2000):
        # float32 products of 2000 rows summed in float64: rounding ~1e-6 of the largest eigenvalue, far below λ
        block = phi[i : i + 2000]
        gram += block.T @ block
        rhs += block.T.astype(np.float64) @ y[i : i + 2000]
    means = []
    for lam in lams:
        a = gram.copy()
        a[np.diag_indices_from(a)] += lam
        factor = scipy.linalg.cho_factor(a.T, overwrite_a=True, check_finite=False)  # a.T: in place, as above
        means.append(phi_test.astype(np.float64) @ scipy.linalg.cho_solve(factor, rhs, check_finite=False))
        del a, factor
    return means


def kernel_errors(
    phi: np.ndarray, theta: np.ndarray, norm: float, trace: np.ndarray
) -> tuple[float, float, np.ndarray]:
    """‖ΦΦᵀ − Θ‖_F / ‖Θ‖_F (FULL), the TRACE kernel's, and the TRACE feature kernel (N × N); float32 products."""
    sq = 0.0
    for i in range(0, phi.shape[0], 1000):
        block = (phi[i : i + 1000] @ phi.T).astype(np.float64)
        block -= theta[i : i + 1000]
        sq += float(np.einsum("ij,ij->", block, block))
    n = trace.shape[0]
    flat = phi.reshape(n, -1)  # (N, k·D): Σ_a Φ[n, a]·Φ[m, a] is one dot product
    trace_phi = (flat @ flat.T).astype(np.float64)
    return (sq**0.5) / norm, float(np.linalg.norm(trace_phi - trace) / np.linalg.norm(trace)), trace_phi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000, help="training examples")
    parser.add_argument("--n-test", type=int, default=500)
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--seeds", type=int, default=2, help="seeds at D ≤ --seed-max-dim (one above)")
    parser.add_argument("--seed-max-dim", type=int, default=1024)
    parser.add_argument("--ridges", type=float, nargs="+", default=[1e-3, 1e-1], help="× the mean diagonal")
    parser.add_argument("--separation", type=float, default=0.12, help="class-mean scale s of the mixture")
    parser.add_argument("--sketch", default="structured", choices=["structured", "gaussian"])
    parser.add_argument("--cache", type=Path, default=Path("/tmp/ntk_bench_features"))
    args = parser.parse_args()

    n, m = args.n, args.n_test
    x, classes = mixture(n + m, args.separation)
    x_train, x_test = x[:n], x[n:]
    onehot = np.eye(K)[classes]
    y, truth, test_classes = onehot[:n].reshape(-1), onehot[n:], classes[n:]
    cache = args.cache / f"n{n}_m{m}_s{args.separation:g}"
    theta, theta_test, trace = exact_kernels(x_train, x_test, cache)
    norm = float(np.sqrt(sum(float(np.einsum("ij,ij->", b, b)) for b in np.array_split(theta, 20))))
    tr = float(np.trace(theta))
    lams = [r * tr / (n * K) for r in args.ridges]
    # the TRACE kernel's test rows Σ_a Θ(x*, x)[a, a]; its ridge is the same multiple of its own mean diagonal
    trace_test = np.einsum("iaja->ij", theta_test.reshape(m, K, n, K))
    trace_lams = [r * tr / n for r in args.ridges]
    trace_exact = []
    for r, lam in zip(args.ridges, trace_lams, strict=True):
        mean = trace_gp(trace, trace_test, onehot[:n], lam)
        trace_exact.append(mean)
        print(f"exact TRACE GP ridge {r:g}: test MSE {np.mean((mean - truth) ** 2):.4f}, "
              f"accuracy {np.mean(mean.argmax(1) == test_classes):.3f}")  # fmt: skip
    print(f"MLP 784-512-512-10, N = {n} train + {m} test, mixture s = {args.separation:g}, FULL; label variance "
          f"{np.var(truth):.4f}; (tr Θ)²/‖Θ‖²_F = {(tr / norm) ** 2:.0f}, Gaussian-sketch constant "
          f"√(1 + that) = {(1 + (tr / norm) ** 2) ** 0.5:.2f}")  # fmt: skip

    exact_file = cache / "exact_gp.json"
    stored = json.loads(exact_file.read_text()) if exact_file.exists() else {}
    exact: dict[float, tuple[float, float]] = {}
    for r, lam in zip(args.ridges, lams, strict=True):
        if f"{r:g}" not in stored:
            start = time.perf_counter()
            mean = exact_gp(cache / "theta_train.npy", theta_test, y, lam).reshape(m, K)
            stored[f"{r:g}"] = [float(np.mean((mean - truth) ** 2)), float(np.mean(mean.argmax(1) == test_classes))]
            print(f"  exact GP ridge {r:g}: {time.perf_counter() - start:.0f} s", flush=True)
            exact_file.write_text(json.dumps(stored))
        exact[r] = tuple(stored[f"{r:g}"])  # type: ignore[assignment]
        print(f"exact GP ridge {r:g}: test MSE {exact[r][0]:.4f}, accuracy {exact[r][1]:.3f}")

    gp_head = " ".join(f"{'MSE/acc r=' + format(r, 'g'):>18}" for r in args.ridges)
    gp_head += " " + " ".join(f"{'TRACE r=' + format(r, 'g'):>18}" for r in args.ridges)
    print(f"{'D':>6} {'seed':>4} {'FULL err':>9} {'×√D':>6} {'TRACE err':>10} {gp_head} {'s/call':>7} "
          f"{'Φ MiB':>7} {'peak MiB':>8}  load")  # fmt: skip
    model = make_mlp()
    for d in args.dims:
        for s in range(args.seeds if d <= args.seed_max_dim else 1):
            start = time.perf_counter()
            phi_all = ntk_features(model, x, dim=d, seed=s, sketch=args.sketch)
            secs = time.perf_counter() - start
            load = _load()
            mib = phi_all.numel() * phi_all.element_size() / 2**20
            phi_np = phi_all.numpy()
            phi, phi_test = phi_np[:n].reshape(n * K, d), phi_np[n:].reshape(m * K, d)
            full_err, trace_err, trace_phi = kernel_errors(phi, theta, norm, trace)
            cells = []
            for mean in feature_gp(phi, phi_test, y, lams):
                mean = mean.reshape(m, K)
                cells.append(f"{np.mean((mean - truth) ** 2):.4f}/{np.mean(mean.argmax(1) == test_classes):.3f}")
            flat, flat_test = phi_np[:n].reshape(n, -1), phi_np[n:].reshape(m, -1)
            trace_phi_test = (flat_test @ flat.T).astype(np.float64)
            for lam in trace_lams:
                mean = trace_gp(trace_phi, trace_phi_test, onehot[:n], lam)
                cells.append(f"{np.mean((mean - truth) ** 2):.4f}/{np.mean(mean.argmax(1) == test_classes):.3f}")
            gp_cells = " ".join(f"{c:>18}" for c in cells)
            print(f"{d:>6} {s:>4} {full_err:>9.4f} {full_err * d**0.5:>6.2f} {trace_err:>10.4f} {gp_cells} "
                  f"{secs:>7.1f} {mib:>7.0f} {_peak_mib():>8.0f}  {load}", flush=True)  # fmt: skip
            del phi_all, phi_np, phi, phi_test


if __name__ == "__main__":
    main()
