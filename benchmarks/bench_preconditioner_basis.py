"""Which preconditioner basis a FULL kernel ridge solve needs where n = N·k > P (issue 38, the N = 100,000 run).

The N = 100,000 FULL solve on the benchmark MLP (P = 669,706) has n = 10⁶ rows > P: Θ = J Jᵀ has n − P zero
eigenvalues and its P others run down continuously towards them. That run is hours of CPU, so this script takes a
dense analogue with the same ratio n / P ≈ 1.5 (MLP d-w-w-10, default 64-64-64-10, P = 8970, N = 1350, standard
normal inputs, the classes of a random linear teacher, ridge 1e-3 × the mean diagonal) and counts the iterations
of float64 PCG on the dense FULL kernel to a true relative residual of rtol 1e-3, with the deflation (Frangella,
Tropp and Udell's Nyström preconditioner, NOTE [nystrom preconditioner], here built from *exact* eigenpairs so the
basis is the only variable) taken from:

- ``shared``: the top m eigenvectors of Θ_s = Θ_trace / k, applied to every output (u ⊗ e_i, what the solver's
  shared and adaptive preconditioners build: NOTE [shared nystrom]), and ``kron``: Θ_s ⊗ B with B the k × k
  output covariance (from the example diagonal, or fitted over all pairs);
- ``per-output``: the top m eigenvectors of each output's own kernel Θ_ii (block diagonal over outputs);
- ``full-nystrom``: the Nyström approximation of the FULL kernel from s uniform landmark examples with all their
  k outputs (s·k columns Θ_full(x, x[S]));
- ``full``: the top r eigenvectors of the FULL kernel itself (its exact eigendecomposition: minutes);
- ``kfac``: primal CG on (JᵀJ + λI) w = Jᵀy preconditioned by K-FAC or EKFAC (the per-layer Kronecker factors of
  JᵀJ: activations ⊗ output-cotangents), stopped on the same dual residual, α = (y − J w) / λ.

Prints the spectrum (eigenvalue / λ quantiles) and each method's iterations. Run with OMP_WAIT_POLICY=PASSIVE:
    python benchmarks/bench_preconditioner_basis.py --sections shared kron per-output full kfac
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

from ntk_service.kernels import compute_ntk

Apply = Callable[[np.ndarray], np.ndarray]


class Problem:
    """The dense analogue: FULL kernel A (n, n) in the example-major layout, targets y (n,), the ridge."""

    def __init__(self, d: int, width: int, n_examples: int, k: int = 10, ridge: float = 1e-3) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(
            nn.Linear(d, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, k)
        ).double()
        self.x = torch.randn(n_examples, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        teacher = torch.randn(d, k, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        classes = (self.x @ teacher).argmax(1).numpy()
        self.k, self.n = k, n_examples
        self.y = (np.eye(k)[classes] - 1.0 / k).reshape(-1)
        self.theta = compute_ntk(self.model, self.x, mode="full").theta.numpy()  # (N, N, k, k)
        self.a = self.theta.transpose(0, 2, 1, 3).reshape(n_examples * k, n_examples * k)
        self.lam = ridge * float(np.mean(np.diag(self.a)))
        self.p = sum(p.numel() for p in self.model.parameters())

    def pcg(self, prec: Apply, rtol: float = 1e-3, cap: int = 5000) -> int:
        """Iterations of PCG on (A + λI) α = y until the true relative residual ≤ rtol (cap if never)."""
        a, y, lam = self.a, self.y, self.lam
        x = np.zeros_like(y)
        r = y.copy()
        z = prec(r)
        p = z.copy()
        rz = r @ z
        for it in range(1, cap + 1):
            q = a @ p + lam * p
            step = rz / (p @ q)
            x += step * p
            r -= step * q
            if np.linalg.norm(y - a @ x - lam * x) / np.linalg.norm(y) <= rtol:
                return it
            z = prec(r)
            rz, old = r @ z, rz
            p = z + (rz / old) * p
        return cap


def deflation(basis: np.ndarray, values: np.ndarray, lam: float) -> Apply:
    """P⁻¹ = I + U (floor / (Λ + λ) − 1) Uᵀ, floor the smallest kept Λ + λ (NOTE [nystrom preconditioner])."""
    factor = (values.min() + lam) / (values + lam) - 1.0
    return lambda r: r + basis @ (factor * (basis.T @ r))


def top(matrix: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    values, vectors = np.linalg.eigh(matrix)
    return values[::-1][:m].copy(), vectors[:, ::-1][:, :m].copy()


def section_shared(pb: Problem, ranks: list[int], b: np.ndarray | None = None, label: str = "shared") -> None:
    s = np.einsum("abii->ab", pb.theta) / pb.k
    beta, q = np.linalg.eigh(np.eye(pb.k) if b is None else b)
    for m in ranks:
        values, vectors = top(s, m)
        basis, lams = np.kron(vectors, q), np.kron(values, beta)
        print(f"  {label} m = {m} ({m * pb.k} directions): {pb.pcg(deflation(basis, lams, pb.lam))} iterations",
              flush=True)  # fmt: skip


def section_kron(pb: Problem, ranks: list[int]) -> None:
    t = pb.theta
    s = np.einsum("abii->ab", t) / pb.k
    diag_b = pb.k * np.einsum("aaij->ij", t) / np.einsum("aaii->", t)
    fit_b = np.einsum("abij,ab->ij", t, s) / np.sum(s * s)
    for name, b in (("diagonal", diag_b), ("fit", fit_b)):
        print(f"  B from the {name}: eigenvalues {np.round(np.linalg.eigvalsh(b), 2)}", flush=True)
        section_shared(pb, ranks, b, label=f"kron (B {name})")


def section_per_output(pb: Problem, ranks: list[int]) -> None:
    n, k = pb.n, pb.k
    for m in ranks:
        bases, lams = [], []
        for i in range(k):
            values, vectors = top(pb.theta[:, :, i, i], m)
            basis = np.zeros((n * k, m))
            basis[i::k] = vectors
            bases.append(basis)
            lams.append(values)
        its = pb.pcg(deflation(np.concatenate(bases, 1), np.concatenate(lams), pb.lam))
        print(f"  per-output m = {m} ({m * k} directions): {its} iterations", flush=True)


def section_full_nystrom(pb: Problem, examples: list[int]) -> None:
    """Nyström of the FULL kernel from s uniform landmark examples with all k outputs (s·k columns)."""
    rng = np.random.default_rng(0)
    for s in examples:
        cols = (rng.choice(pb.n, size=s, replace=False)[:, None] * pb.k + np.arange(pb.k)).reshape(-1)
        c = pb.a[:, cols]
        w_values, w_vectors = np.linalg.eigh(c[cols])
        keep = w_values > w_values.max() * cols.size * np.finfo(float).eps
        f = c @ (w_vectors[:, keep] / np.sqrt(w_values[keep]))  # A ≈ F Fᵀ
        g_values, g_vectors = np.linalg.eigh(f.T @ f)
        keep = g_values > g_values.max() * f.shape[0] * np.finfo(float).eps
        basis = f @ (g_vectors[:, keep] / np.sqrt(g_values[keep]))
        its = pb.pcg(deflation(basis, g_values[keep], pb.lam))
        print(f"  full Nyström, s = {s} landmark examples ({s * pb.k} columns): {its} iterations", flush=True)


def section_full(pb: Problem, ranks: list[int]) -> None:
    start = time.perf_counter()
    values, vectors = np.linalg.eigh(pb.a)
    values, vectors = values[::-1], vectors[:, ::-1]
    print(f"  (eigendecomposition {time.perf_counter() - start:.0f} s) eigenvalue / λ at rank "
          + ", ".join(f"{r}: {values[r] / pb.lam:.3g}" for r in ranks if r < values.size), flush=True)  # fmt: skip
    for r in ranks:
        its = pb.pcg(deflation(vectors[:, :r], values[:r], pb.lam))
        print(f"  full r = {r} directions: {its} iterations", flush=True)


def section_kfac(pb: Problem) -> None:
    model, x, k, n, lam = pb.model, pb.x, pb.k, pb.n, pb.lam
    params = {name: p.detach() for name, p in model.named_parameters()}
    jac = vmap(jacrev(lambda p, xi: functional_call(model, p, (xi[None],))[0]), (None, 0))(params, x)
    jmat = np.concatenate([jac[name].reshape(n * k, -1).numpy() for name in params], axis=1)
    offsets, o = {}, 0
    for name, p in params.items():
        offsets[name] = (o, o + p.numel())
        o += p.numel()
    layers, h = [], x
    for i, module in enumerate(model):
        if isinstance(module, nn.Linear):
            act = torch.cat([h, torch.ones(n, 1, dtype=h.dtype)], 1).numpy()
            layers.append((f"{i}.weight", f"{i}.bias", act, jac[f"{i}.bias"].numpy()))  # g: (N, k, out)
        h = module(h).detach()

    def preconditioner(kind: str) -> Apply:
        blocks = []
        for wname, bname, act, g in layers:
            sa, qa = np.linalg.eigh(act.T @ act / n)
            sg, qg = np.linalg.eigh(np.einsum("nko,nkp->op", g, g))
            if kind == "ekfac":  # the exact second moments in the Kronecker eigenbasis
                scale = np.einsum("nkj,nl->jl", np.einsum("nko,oj->nkj", g, qg) ** 2, (act @ qa) ** 2)
            else:
                scale = np.outer(sg, sa)
            blocks.append((wname, bname, qa, qg, scale))

        def apply(v: np.ndarray) -> np.ndarray:
            z = np.empty_like(v)
            for wname, bname, qa, qg, scale in blocks:
                (w0, w1), (b0, b1) = offsets[wname], offsets[bname]
                out = b1 - b0
                m = np.concatenate([v[w0:w1].reshape(out, -1), v[b0:b1, None]], 1)
                r = qg @ ((qg.T @ m @ qa) / (scale + lam)) @ qa.T
                z[w0:w1], z[b0:b1] = r[:, :-1].reshape(-1), r[:, -1]
            return z

        return apply

    y = pb.y
    for kind in ("none", "kfac", "ekfac"):
        prec: Apply = (lambda v: v.copy()) if kind == "none" else preconditioner(kind)
        b = jmat.T @ y
        w = np.zeros(pb.p)
        r = b.copy()
        z = prec(r)
        p = z.copy()
        rz = r @ z
        its = 5000
        for it in range(1, 5001):
            q = jmat.T @ (jmat @ p) + lam * p
            step = rz / (p @ q)
            w += step * p
            r -= step * q
            alpha = (y - jmat @ w) / lam
            if np.linalg.norm(y - jmat @ (jmat.T @ alpha) - lam * alpha) / np.linalg.norm(y) <= 1e-3:
                its = it
                break
            z = prec(r)
            rz, old = r @ z, rz
            p = z + (rz / old) * p
        print(f"  primal CG, {kind}: {its} iterations", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=["shared", "kron", "per-output"],
                        choices=["shared", "kron", "per-output", "full", "full-nystrom", "kfac"])  # fmt: skip
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--n", type=int, default=1350, help="examples N (n = N·k rows)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[200, 610, 1300])
    parser.add_argument("--full-ranks", type=int, nargs="+", default=[610, 2000, 6100])
    args = parser.parse_args()
    pb = Problem(args.d, args.width, args.n)
    ev = np.linalg.eigvalsh(pb.a) / pb.lam if "full" not in args.sections else None
    print(f"MLP {args.d}-{args.width}-{args.width}-10, P = {pb.p}, N = {pb.n}, n = N·k = {pb.n * pb.k} "
          f"(n / P = {pb.n * pb.k / pb.p:.2f}), ridge 1e-3 × mean diagonal, float64, PCG to rtol 1e-3, load "
          f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}", flush=True)  # fmt: skip
    if ev is not None:
        print(f"  eigenvalue / λ quantiles 10/30/50/70/90 %: {np.round(np.quantile(ev, [.1, .3, .5, .7, .9]), 1)}; "
              f"top {ev.max():.3g}", flush=True)  # fmt: skip
    print(f"  no preconditioner: {pb.pcg(lambda r: r.copy())} iterations", flush=True)
    for section in args.sections:
        if section == "shared":
            section_shared(pb, args.ranks)
        elif section == "kron":
            section_kron(pb, args.ranks[:1])
        elif section == "per-output":
            section_per_output(pb, args.ranks)
        elif section == "full":
            section_full(pb, args.full_ranks)
        elif section == "full-nystrom":
            section_full_nystrom(pb, args.ranks)
        else:
            section_kfac(pb)


if __name__ == "__main__":
    main()
