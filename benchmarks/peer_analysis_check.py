"""Cross-check ``linearized_predictions`` against neural-tangents' ``predict.gradient_descent_mse`` (float64), and
its cross-entropy gradient flow against ``predict.gradient_descent`` with a cross-entropy loss.

The conventions that decide whether numbers match (docs/analysis.md): neural-tangents integrates
df/dt = −(η_NT / (N·k)) Θ (f − y), our ``loss="half_mse"`` at η = η_NT and ``loss="mse"`` at η = η_NT / 2; its trace
kernel is the mean over outputs, ours the sum, so it gets ours / k; its relative ``diag_reg`` is our
``ridge_scale="relative"``. ``predict.gradient_descent`` integrates df/dt = −η_NT Θ ∇_f loss, which is our
``loss="cross_entropy"`` at η = η_NT when its loss is the mean over examples (nn.CrossEntropyLoss()); it solves the
ODE with jax's ``odeint`` at rtol = atol = 1.4e-8, so that comparison is held to 1e-6, not 1e-9. The same random
kernels go through both; neural-tangents runs in ``.peer-venv``
(``make peer-venv``) as a subprocess.

    .venv/bin/python benchmarks/peer_analysis_check.py
"""

from __future__ import annotations

import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from ntk_service.analysis import linearized_predictions  # noqa: E402

PEER_PYTHON = ROOT / ".peer-venv" / "bin" / "python"

_PEER = """
import sys
import types
# as in peer_neural_tangents.py: an empty stand-in for neural_tangents.experimental (the TensorFlow bridge)
sys.modules.setdefault("neural_tangents.experimental", types.ModuleType("neural_tangents.experimental"))
import jax
jax.config.update("jax_enable_x64", True)
import numpy as np
import neural_tangents as nt

d = dict(np.load(sys.argv[1]))
out = {}
for name, (k, kt, trace_axes) in {
    "full": (d["theta"], d["theta_test"], ()),
    "trace": (d["trace"] / d["k"], d["trace_test"] / d["k"], (-1,)),
}.items():
    for ridge_name, ridge in (("none", 0.0), ("relative", float(d["ridge"]))):
        fn = nt.predict.gradient_descent_mse(k, d["y"], learning_rate=float(d["lr"]), diag_reg=ridge,
                                             trace_axes=trace_axes)
        train, test = fn(d["times"], d["f0"], d["f0_test"], kt)
        out[f"{name}-{ridge_name}-train"], out[f"{name}-{ridge_name}-test"] = np.asarray(train), np.asarray(test)
    train, test = nt.predict.gradient_descent_mse(k, d["y"], learning_rate=float(d["lr"]), trace_axes=trace_axes)(
        None, d["f0"], d["f0_test"], kt)
    out[f"{name}-inf-train"], out[f"{name}-inf-test"] = np.asarray(train), np.asarray(test)
    # cross-entropy as nn.CrossEntropyLoss(): the mean over the N examples of -log softmax at the label
    onehot = np.eye(int(d["k"]))[d["labels"]]
    ce = lambda fx, y_hat: -jax.numpy.sum(jax.nn.log_softmax(fx) * y_hat) / fx.shape[0]
    fn = nt.predict.gradient_descent(ce, k, onehot, learning_rate=float(d["ce_lr"]), trace_axes=trace_axes)
    train, test = fn(d["ce_times"], d["f0"], d["f0_test"], kt)
    out[f"{name}-ce-train"], out[f"{name}-ce-test"] = np.asarray(train), np.asarray(test)
np.savez(sys.argv[2], **out)
"""


def main() -> None:
    if not PEER_PYTHON.exists():
        raise SystemExit("no .peer-venv: run `make peer-venv` first")
    rng = np.random.default_rng(0)
    n, m, k, p = 8, 5, 3, 60
    j, jt = rng.standard_normal((n, k, p)) / np.sqrt(p), rng.standard_normal((m, k, p)) / np.sqrt(p)
    theta, theta_test = np.einsum("naf,mbf->nmab", j, j), np.einsum("naf,mbf->nmab", jt, j)
    trace, trace_test = np.einsum("nmaa->nm", theta), np.einsum("nmaa->nm", theta_test)
    data = {
        "theta": theta, "theta_test": theta_test, "trace": trace, "trace_test": trace_test, "k": float(k),
        "y": rng.standard_normal((n, k)), "f0": rng.standard_normal((n, k)), "f0_test": rng.standard_normal((m, k)),
        "times": np.array([0.0, 0.5, 3.0, 40.0]), "lr": 0.7, "ridge": 0.1,
        "labels": rng.integers(0, k, n), "ce_times": np.array([0.0, 1.0, 10.0, 60.0]), "ce_lr": 2.0,
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        np.savez(Path(tmp) / "in.npz", **data)
        subprocess.run([str(PEER_PYTHON), "-c", _PEER, str(Path(tmp) / "in.npz"), str(Path(tmp) / "out.npz")],
                       check=True)  # fmt: skip
        peer = dict(np.load(Path(tmp) / "out.npz"))
    worst = 0.0
    for name, (kernel, kernel_test) in {"full": (theta, theta_test), "trace": (trace, trace_test)}.items():
        for loss, lr in (("half_mse", data["lr"]), ("mse", data["lr"] / 2)):
            for ridge_name, ridge in (("none", 0.0), ("relative", data["ridge"])):
                ours = linearized_predictions(
                    kernel, data["y"], times=data["times"], learning_rate=lr, loss=loss, k_test_train=kernel_test,
                    f0_train=data["f0"], f0_test=data["f0_test"], ridge=ridge, ridge_scale="relative",
                )  # fmt: skip
                assert ours.test is not None
                for split, got in (("train", ours.train), ("test", ours.test)):
                    want = peer[f"{name}-{ridge_name}-{split}"]
                    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                    worst = max(worst, err)
                    print(f"{name:5s} loss={loss:8s} ridge={ridge_name:8s} {split:5s}: max rel. difference {err:.1e}")
        ours = linearized_predictions(
            kernel, data["y"], times=[math.inf], learning_rate=1.0, k_test_train=kernel_test,
            f0_train=data["f0"], f0_test=data["f0_test"],
        )  # fmt: skip
        assert ours.test is not None
        for split, got in (("train", ours.train[0]), ("test", ours.test[0])):
            want = peer[f"{name}-inf-{split}"]
            err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
            worst = max(worst, err)
            print(f"{name:5s} t=inf                   {split:5s}: max rel. difference {err:.1e}")
    worst_ce = 0.0
    for name, (kernel, kernel_test) in {"full": (theta, theta_test), "trace": (trace, trace_test)}.items():
        ours = linearized_predictions(
            kernel, data["labels"], times=data["ce_times"], learning_rate=data["ce_lr"], loss="cross_entropy",
            k_test_train=kernel_test, f0_train=data["f0"], f0_test=data["f0_test"],
        )  # fmt: skip
        assert ours.test is not None
        for split, got in (("train", ours.train), ("test", ours.test)):
            want = peer[f"{name}-ce-{split}"]
            err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
            worst_ce = max(worst_ce, err)
            print(f"{name:5s} loss=cross_entropy (flow)   {split:5s}: max rel. difference {err:.1e}")
    print(f"worst: {worst:.1e} (MSE, closed forms); {worst_ce:.1e} (cross-entropy, two ODE solvers)")
    if worst > 1e-9 or worst_ce > 1e-6:
        raise SystemExit("MISMATCH with neural-tangents")


if __name__ == "__main__":
    main()
