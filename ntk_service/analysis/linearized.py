"""What gradient descent on the linearized network f0 + J(θ − θ0) does (Lee et al. 2019), from Θ alone.

NOTE [losses and time scales]
    Training minimizes L(f) over the N training examples, k outputs each; with L's gradient in f equal to
    c · (f − y), the outputs follow df/dt = −η · c · Θ (f − y) under gradient flow at learning rate η, and
    f ← f − η · c · Θ (f − y) per step of gradient descent. The loss names the reduction as PyTorch does:

    ========== =============================== ============ ==============================================
    loss       L                               c            neural-tangents' η_NT for the same dynamics
    ========== =============================== ============ ==============================================
    "mse"      MSELoss(): mean over all N·k    2 / (N·k)    2η
    "sum"      MSELoss(reduction="sum")        2            2η·N·k
    "half_mse" ½ · mean over all N·k           1 / (N·k)    η (``predict.gradient_descent_mse``)
    ========== =============================== ============ ==============================================

    ``loss="cross_entropy"`` (``nn.CrossEntropyLoss()`` on class indices) is not quadratic: its dynamics are
    integrated in function space instead (NOTE [cross-entropy dynamics] in ``cross_entropy.py``).

    N·k counts every entry even for a TRACE kernel (neural-tangents' |y| does too). With r0 = f0 − y and
    Θ = V diag(λ) Vᵀ, gradient flow gives f_train(t) = y + V e^{−ηcλt} Vᵀ r0 and
    f_test(t) = f0* − Θ* V diag((1 − e^{−ηcλt}) / λ) Vᵀ r0; gradient descent after s steps replaces e^{−ηcλt} by
    (1 − ηcλ)^s, exactly (no discretization error: the linearized model is linear in θ). Frozen modes
    (λ ≤ tol, NOTE [non-positive modes] in ``eigen.py``) do not move; t = ∞ is the pseudo-inverse limit
    f_test = f0* − Θ* Θ⁺ r0, and f_train = y on the active modes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ntk_service._tensors import is_torch_tensor
from ntk_service.analysis.blas_guard import large_matrix_blas
from ntk_service.analysis.cross_entropy import cross_entropy_dynamics, cross_entropy_on_operator
from ntk_service.analysis.eigen import DEFAULT_RCOND, SymmetricEigen
from ntk_service.analysis.layout import to_float64, to_kernel_matrix, to_targets
from ntk_service.analysis.ridge import RidgeScale, ridge_value
from ntk_service.analysis.solve import CgOptions, KernelOperator, is_operator, kernel_operator
from ntk_service.analysis.solve.krylov import krylov_predictions, operator_lambda_max
from ntk_service.errors import InvalidInput, ShapeMismatch, UnstableLearningRate
from ntk_service.kernels.modes import KernelMode

__all__ = [
    "PREDICTION_COPIES",
    "Flow",
    "LinearizedPredictions",
    "Loss",
    "linearized_memory_bytes",
    "linearized_predictions",
    "loss_scale",
    "max_learning_rate",
]

Loss = Literal["mse", "sum", "half_mse", "cross_entropy"]
"""The training loss, named as PyTorch names its reduction (NOTE [losses and time scales]); "cross_entropy" is
``nn.CrossEntropyLoss()`` on class indices (NOTE [cross-entropy dynamics])."""

Flow = Literal["gradient_flow", "gradient_descent"]
"""Continuous-time closed form, or the exact discrete iterate for integer step counts."""

_OPERATION = "linearized_predictions"

PREDICTION_COPIES = 5
"""s×s float64 arrays alive at the peak of ``linearized_predictions`` on a dense kernel of size s: the caller's
kernel, its matrix here, and eigh's copy, eigenvectors and workspace (LAPACK's divide and conquer needs ~2·s²
more)."""


def linearized_memory_bytes(n: int, m: int, k: int, *, full: bool) -> int:
    """Peak bytes of ``linearized_predictions`` on dense float64 kernels, the caller's included: Θ(train, train)
    of size s = N·k (FULL) or N (TRACE) ``PREDICTION_COPIES`` times, and Θ(test, train) (M·k × N·k, or M × N)
    twice (the caller's and its matrix here).

    Args:
        n (int): N, the training examples. m (int): M, the test examples (0: none). k (int): outputs per example.
        full (bool): a FULL kernel (True) or a TRACE one.

    Returns:
        int: bytes.
    """
    size = n * k if full else n
    cross = m * k * n * k if full else m * n
    return 8 * (PREDICTION_COPIES * size * size + 2 * cross)


def loss_scale(loss: Loss | str, n_entries: int) -> float:
    """c of NOTE [losses and time scales]: the loss's gradient in f is c · (f − y); ``n_entries`` = N·k.

    Raises:
        InvalidInput: an unknown loss name.
    """
    if loss == "mse":
        return 2.0 / n_entries
    if loss == "sum":
        return 2.0
    if loss == "half_mse":
        return 1.0 / n_entries
    if loss == "cross_entropy":
        raise InvalidInput(
            f"{_OPERATION}: loss 'cross_entropy' has no constant scale c (its gradient in f is softmax(f) − onehot, "
            "not c · (f − y)); linearized_predictions(..., loss='cross_entropy') reports its step bound"
        )
    raise InvalidInput(
        f"{_OPERATION}: unknown loss {loss!r}; expected 'mse' (MSELoss()), 'sum', 'half_mse' or 'cross_entropy'"
    )


@dataclass(frozen=True)
class LinearizedPredictions:
    """Outputs of the linearized network at each time.

    Attributes:
        times: (T,) the times (or step counts) asked for; ``inf`` allowed.
        train: (T, N, k) outputs on the training inputs.
        test: (T, M, k) outputs on the test inputs; None without ``k_test_train``.
        lambda_min, lambda_max: extreme eigenvalues of the training kernel as used (after ridge; TRACE / k).
        frozen_modes: modes with λ ≤ tol that did not move (NOTE [non-positive modes]).
        tol: that threshold. path: how it was computed, e.g. "gradient_flow: eigh; t=inf: eigen pseudo-inverse".
        max_learning_rate: the largest stable step of gradient descent for this loss (cross-entropy: the
            descent-lemma bound 4N / λmax, not a refusal threshold).
        rtol, atol: the ODE solver's tolerances where one ran (cross-entropy gradient flow), else None.
        solves: on an operator, the CG (t = ∞) and Lanczos (finite t) runs, each with ``converged`` and its cost;
            empty for the dense path. converged: every one of them converged (True for the dense path).
    """

    times: np.ndarray
    train: np.ndarray
    test: np.ndarray | None
    lambda_min: float
    lambda_max: float
    frozen_modes: int
    tol: float
    path: str
    max_learning_rate: float
    rtol: float | None = None
    atol: float | None = None
    solves: tuple[Any, ...] = ()

    @property
    def converged(self) -> bool:
        return all(bool(s.converged) for s in self.solves)


def _stable_limit(lambda_max: float, c: float) -> float:
    return math.inf if lambda_max <= 0 else 2.0 / (c * lambda_max)


def max_learning_rate(
    k_train_train: Any, *, loss: Loss | str = "mse", n_outputs: int | None = None, mode: KernelMode | str | None = None
) -> float:
    """The largest learning rate at which gradient descent on the linearized model does not diverge.

    The step multiplies the residual's component along λ by 1 − η·c·λ; that stays in (−1, 1) for every λ > 0
    iff η < 2 / (c · λmax). For ``MSELoss()`` that is N·k / λmax. (neural-tangents' ``max_learning_rate`` returns
    2(1 + momentum)·|y| / λmax in its own η_NT, the "half_mse" scale.) Cost: one eigh, O((N·k)³).

    Args:
        k_train_train: (N, N, k, k) FULL or (N, N) TRACE kernel (read as trace / k ⊗ I_k).
        loss (str): "mse" | "sum" | "half_mse". Default: "mse".
        n_outputs (int | None): k, required for a TRACE kernel (ignored for FULL). Default: None.
        mode: checked against the shape. Default: inferred.

    Returns:
        The limit η*; ``inf`` for a kernel with no positive eigenvalue.

    On an operator (an ``NtkOperator``, or any object with ``shape`` and ``matvec``, NOTE [operator layout]) λmax
    comes from Lanczos (``eigsh``, a few dozen products); an ``NtkOperator`` knows its k, any other operator needs
    n_outputs.

    Raises:
        ShapeMismatch: a non-square kernel. InvalidInput: an unknown loss, a TRACE kernel without n_outputs.
    """
    if is_operator(k_train_train):
        k_op = n_outputs if n_outputs is not None else getattr(k_train_train, "k", None)
        if k_op is None:
            raise InvalidInput(
                "max_learning_rate: an operator does not say how many outputs per example it has; pass n_outputs=k"
            )
        op = kernel_operator(k_train_train, k=int(k_op), name="k_train_train", operation="max_learning_rate", mode=mode)
        if op.rows != op.cols:
            raise ShapeMismatch(f"max_learning_rate: the operator has shape {op.shape}; it must be square")
        return _stable_limit(operator_lambda_max(op), loss_scale(loss, op.n * int(k_op)))
    kernel = to_kernel_matrix(
        k_train_train,
        name="k_train_train",
        operation="max_learning_rate",
        mode=mode,
        square=True,
        symmetrize=True,
        trace_outputs=n_outputs,
    )
    if kernel.k is None and n_outputs is None:
        raise InvalidInput(
            "max_learning_rate: a TRACE kernel does not say how many outputs it summed; pass n_outputs=k "
            "(the limit scales with k² through trace / k and the loss's mean over N·k entries)"
        )
    k = kernel.k if kernel.k is not None else int(n_outputs or 1)
    with large_matrix_blas(kernel.matrix.shape[0]):  # NOTE [large blas]
        lambda_max = float(np.linalg.eigvalsh(kernel.matrix)[-1])
    return _stable_limit(lambda_max, loss_scale(loss, kernel.n * k))


def _check_times(times: Sequence[float] | np.ndarray, flow: str) -> np.ndarray:
    array = np.asarray(times, dtype=np.float64).reshape(-1)
    if array.size == 0:
        raise InvalidInput(f"{_OPERATION}: times is empty; give at least one time, e.g. [0, 10, inf]")
    if np.any(np.isnan(array)) or np.any(array < 0):
        raise InvalidInput(f"{_OPERATION}: times must be ≥ 0 (inf allowed), got {array.tolist()}")
    if flow == "gradient_descent":
        finite = array[np.isfinite(array)]
        if np.any(finite != np.round(finite)):
            raise InvalidInput(
                f"{_OPERATION}: with flow='gradient_descent', times are step counts and must be integers "
                f"(or inf), got {array.tolist()}; use flow='gradient_flow' for continuous time"
            )
    return array


def _mode_factors(eig: SymmetricEigen, rate: float, t: float, flow: str) -> tuple[np.ndarray, np.ndarray]:
    """(decay, g) per mode: the residual's factor and the integral factor (1 − decay) / λ at time t.

    Frozen modes give (1, 0): they do not move (NOTE [non-positive modes]). The expm1 / log1p forms keep
    (1 − e^{−x}) / λ accurate where x is tiny (it tends to η·c·t as λ → 0, never 0/0).
    """
    active = eig.active
    lam = np.where(active, eig.eigenvalues, 1.0)
    x = rate * lam
    if math.isinf(t):
        decay, g = np.zeros_like(lam), 1.0 / lam
    elif flow == "gradient_flow":
        decay, g = np.exp(-x * t), -np.expm1(-x * t) / lam
    else:
        # (1 − x)^s: through log1p where 1 − x > 0; directly where x ∈ [1, 2] (an oscillating, shrinking mode).
        below = x < 1
        log_factor = t * np.log1p(-np.where(below, x, 0.0))
        decay = np.where(below, np.exp(log_factor), (1.0 - x) ** t)
        g = np.where(below, -np.expm1(log_factor), 1.0 - decay) / lam
    return np.where(active, decay, 1.0), np.where(active, g, 0.0)


def linearized_predictions(
    k_train_train: Any,
    y_train: Any,
    *,
    times: Sequence[float] | np.ndarray,
    learning_rate: float,
    loss: Loss | str = "mse",
    k_test_train: Any = None,
    f0_train: Any = None,
    f0_test: Any = None,
    ridge: float = 0.0,
    ridge_scale: RidgeScale | str = "absolute",
    flow: Flow | str = "gradient_flow",
    mode: KernelMode | str | None = None,
    rcond: float | None = DEFAULT_RCOND,
    cg: CgOptions | None = None,
) -> LinearizedPredictions:
    """Train and test outputs of the linearized network trained on (x_train, y_train) from f0, at each time.

    See NOTE [losses and time scales] for the formulas and the loss / learning-rate mapping. A TRACE kernel is
    read as (trace / k) ⊗ I_k (NOTE [layout] in ``layout.py``), k = y_train's width.

    Args:
        k_train_train: Θ(x_train, x_train), (N, N, k, k) FULL or (N, N) TRACE, numpy or torch.
        y_train: (N, k) targets (or (N,) for k = 1); for loss="cross_entropy", (N,) integer class indices.
        times (sequence of float): times of gradient flow, or step counts (integers) of gradient descent;
            ``math.inf`` gives the converged limit.
        learning_rate (float): η > 0 of the optimizer on ``loss``.
        loss (str): "mse" (``MSELoss()``), "sum" (``MSELoss(reduction="sum")``), "half_mse", or
            "cross_entropy" (``CrossEntropyLoss()``; no t = ∞; a TRACE kernel needs f0_train (N, k) for k).
            Default: "mse".
        k_test_train: Θ(x_test, x_train), (M, N, k, k) or (M, N). Default: None (no test outputs).
        f0_train: (N, k) outputs at initialization. Default: zeros.
        f0_test: (M, k) outputs at initialization. Default: zeros.
        ridge (float): λ ≥ 0 added to Θ's diagonal (see ``ridge_scale``). Default: 0.
        ridge_scale (str): "absolute" (λI) or "relative" (λ · mean diagonal entry). Default: "absolute".
        flow (str): "gradient_flow" (closed form) or "gradient_descent" (exact iterate). Default: gradient_flow.
        mode: checked against the shapes. Default: inferred from the rank.
        rcond (float | None): modes with λ ≤ rcond · max|λ| are frozen. Default: N·k·eps.
        cg (CgOptions): for an operator k_train_train (an ``NtkOperator`` or any object with ``shape`` and
            ``matvec``): t = ∞ by CG, finite t by Lanczos (NOTE [krylov predictions]); ``cg.rtol`` and
            ``cg.max_iterations`` apply to both. Default: CgOptions().

    Returns:
        LinearizedPredictions: train (T, N, k), test (T, M, k) or None, and the kernel facts used.

    Raises:
        ShapeMismatch: kernels that are not square / do not match each other or the targets.
        InvalidInput: negative times, non-integer steps for gradient descent, η ≤ 0, an unknown loss or flow.
        UnstableLearningRate: gradient descent with η above the stable limit (the message gives the limit).

    Cost: one eigh of the (N·k)² matrix (N² for TRACE), O((N·k)³); then O(T·(N·k)·(M·k)) for the outputs.

        >>> out = linearized_predictions(theta, y, times=[0, 100, math.inf], learning_rate=0.1,
        ...                              k_test_train=theta_test)                  # doctest: +SKIP
        >>> out.train.shape, out.test.shape     # (T, N, k), (T, M, k)             # doctest: +SKIP
    """
    if flow not in ("gradient_flow", "gradient_descent"):
        raise InvalidInput(f"{_OPERATION}: unknown flow {flow!r}; expected 'gradient_flow' or 'gradient_descent'")
    if not math.isfinite(learning_rate) or learning_rate <= 0:
        raise InvalidInput(f"{_OPERATION}: learning_rate must be a positive number, got {learning_rate}")
    time_array = _check_times(times, flow)
    if loss == "cross_entropy":  # not quadratic: function-space dynamics (NOTE [cross-entropy dynamics])
        dynamics = (
            cross_entropy_on_operator
            if is_operator(k_train_train) or is_operator(k_test_train)
            else cross_entropy_dynamics
        )
        run = dynamics(
            k_train_train, y_train, times=time_array, learning_rate=learning_rate, flow=flow,
            k_test_train=k_test_train, f0_train=f0_train, f0_test=f0_test, ridge=ridge, ridge_scale=ridge_scale,
            mode=mode,
        )  # fmt: skip
        return LinearizedPredictions(
            times=run.times, train=run.train, test=run.test, lambda_min=run.lambda_min, lambda_max=run.lambda_max,
            frozen_modes=0, tol=0.0, path=run.path, max_learning_rate=run.max_learning_rate, rtol=run.rtol,
            atol=run.atol,
        )  # fmt: skip
    if is_operator(k_train_train):  # Krylov methods on an operator (NOTE [krylov predictions] in solve/krylov.py)
        return _predictions_on_operator(
            k_train_train, y_train, time_array, learning_rate, loss, k_test_train, f0_train, f0_test, ridge,
            ridge_scale, flow, mode, rcond, cg or CgOptions(),
        )  # fmt: skip
    y_raw = np.asarray(y_train.detach().cpu() if is_torch_tensor(y_train) else y_train)
    k_hint = y_raw.shape[1] if y_raw.ndim == 2 else 1
    kernel = to_kernel_matrix(
        k_train_train,
        name="k_train_train",
        operation=_OPERATION,
        mode=mode,
        square=True,
        symmetrize=True,
        trace_outputs=k_hint,
    )
    n = kernel.n
    y = to_targets(y_train, n=n, k=kernel.k, name="y_train", operation=_OPERATION)
    k = y.shape[1]
    f0 = np.zeros_like(y) if f0_train is None else to_targets(f0_train, n=n, k=k, name="f0_train", operation=_OPERATION)
    c = loss_scale(loss, n * k)
    matrix = kernel.matrix  # a fresh array of ours (to_kernel_matrix copies): the ridge goes on in place
    matrix[np.diag_indices_from(matrix)] += ridge_value(matrix, ridge, ridge_scale, operation=_OPERATION)
    eig = SymmetricEigen.of(matrix, rcond=rcond)
    limit = _stable_limit(eig.lambda_max, c)
    if flow == "gradient_descent" and learning_rate > limit:
        raise UnstableLearningRate(
            f"{_OPERATION}: learning_rate {learning_rate:g} is above the stable limit {limit:.6g} of gradient "
            f"descent for loss {loss!r} on this kernel (λmax = {eig.lambda_max:.6g}); the linearized model "
            f"diverges. Use learning_rate < {limit:.6g}, or flow='gradient_flow'"
        )
    test_matrix, m = _test_matrix(k_test_train, kernel.mode, n=n, k=k, mode=mode)
    f0_star = None
    if test_matrix is not None:
        f0_star = (
            np.zeros((m, k)) if f0_test is None else to_targets(f0_test, n=m, k=k, name="f0_test", operation=_OPERATION)
        )
    elif f0_test is not None:
        raise InvalidInput(f"{_OPERATION}: f0_test was given without k_test_train; pass both or neither")

    # Residuals as columns in the kernel's layout: FULL (N·k, 1), TRACE (N, k) (NOTE [layout]).
    full = kernel.mode is KernelMode.FULL
    r0 = (f0 - y).reshape(n * k, 1) if full else f0 - y
    coeffs = eig.eigenvectors.T @ r0
    rate = learning_rate * c
    train = np.empty((time_array.size, n, k))
    test = None if test_matrix is None else np.empty((time_array.size, m, k))
    for i, t in enumerate(time_array):
        decay, g = _mode_factors(eig, rate, float(t), flow)
        train[i] = (y.reshape(r0.shape) + eig.eigenvectors @ (decay[:, None] * coeffs)).reshape(n, k)
        if test is not None and test_matrix is not None and f0_star is not None:
            moved = test_matrix @ (eig.eigenvectors @ (g[:, None] * coeffs))
            test[i] = f0_star - moved.reshape(m, k)
    path = f"{flow}: eigh of a {matrix.shape[0]}x{matrix.shape[0]} kernel"
    if eig.frozen_modes:
        path += f", {eig.frozen_modes} mode(s) with λ ≤ {eig.tol:.3g} frozen"
    if np.any(np.isinf(time_array)):
        path += "; t=inf: eigen pseudo-inverse"
    return LinearizedPredictions(
        times=time_array,
        train=train,
        test=test,
        lambda_min=eig.lambda_min,
        lambda_max=eig.lambda_max,
        frozen_modes=eig.frozen_modes,
        tol=eig.tol,
        path=path,
        max_learning_rate=limit,
    )


def _test_matrix(
    k_test_train: Any, train_mode: KernelMode, *, n: int, k: int, mode: KernelMode | str | None
) -> tuple[np.ndarray | None, int]:
    """Θ(x_test, x_train) in the training kernel's layout (TRACE / k), and M."""
    if k_test_train is None:
        return None, 0
    test = to_kernel_matrix(k_test_train, name="k_test_train", operation=_OPERATION, mode=mode, trace_outputs=k)
    if test.mode is not train_mode:
        raise ShapeMismatch(
            f"{_OPERATION}: k_test_train is a {test.mode.value} kernel, k_train_train a {train_mode.value} one; "
            "compute both in the same mode"
        )
    if test.m != n or (test.k is not None and test.k != k):
        raise ShapeMismatch(
            f"{_OPERATION}: k_test_train pairs {test.m} training examples with k = {test.k}, k_train_train has "
            f"{n} and k = {k}; pass Θ(x_test, x_train) of shape (M, {n}{f', {k}, {k}' * (test.k is not None)})"
        )
    return test.matrix, test.n


def _predictions_on_operator(
    k_train_train: Any,
    y_train: Any,
    time_array: np.ndarray,
    learning_rate: float,
    loss: Loss | str,
    k_test_train: Any,
    f0_train: Any,
    f0_test: Any,
    ridge: float,
    ridge_scale: RidgeScale | str,
    flow: str,
    mode: KernelMode | str | None,
    rcond: float | None,
    options: CgOptions,
) -> LinearizedPredictions:
    """``linearized_predictions`` on an operator (NOTE [krylov predictions])."""
    y = to_float64(y_train, name="y_train", operation=_OPERATION)
    y = y[:, None] if y.ndim == 1 else y
    if y.ndim != 2:
        raise ShapeMismatch(f"{_OPERATION}: y_train has shape {y.shape}; expected (N, k) or (N,)")
    n, k = y.shape
    train = kernel_operator(k_train_train, k=k, name="k_train_train", operation=_OPERATION, rows=n, cols=n, mode=mode)
    if ridge_scale != "absolute":
        raise InvalidInput(
            f"{_OPERATION}: ridge_scale={ridge_scale!r} on an operator: its diagonal is unknown; pass an absolute ridge"
        )
    lam = ridge_value(np.zeros((1, 1)), ridge, "absolute", operation=_OPERATION)
    f0 = np.zeros_like(y) if f0_train is None else to_targets(f0_train, n=n, k=k, name="f0_train", operation=_OPERATION)
    cross: KernelOperator | None = None
    f0_star = None
    if k_test_train is not None:
        cross = kernel_operator(k_test_train, k=k, name="k_test_train", operation=_OPERATION, cols=n, mode=train.mode)
        f0_star = (
            np.zeros((cross.n, k))
            if f0_test is None
            else to_targets(f0_test, n=cross.n, k=k, name="f0_test", operation=_OPERATION)
        )
    elif f0_test is not None:
        raise InvalidInput(f"{_OPERATION}: f0_test was given without k_test_train; pass both or neither")
    c = loss_scale(loss, n * k)
    lambda_max = operator_lambda_max(train, ridge=lam)
    limit = _stable_limit(lambda_max, c)
    if flow == "gradient_descent" and learning_rate > limit:
        raise UnstableLearningRate(
            f"{_OPERATION}: learning_rate {learning_rate:g} is above the stable limit {limit:.6g} of gradient "
            f"descent for loss {loss!r} on this kernel (λmax ≈ {lambda_max:.6g} by Lanczos); the linearized model "
            f"diverges. Use learning_rate < {limit:.6g}, or flow='gradient_flow'"
        )
    out = krylov_predictions(
        train, cross, y, f0, f0_star, time_array, rate=learning_rate * c, ridge=lam, flow=flow, rcond=rcond,
        options=options, factors=_mode_factors,
    )  # fmt: skip
    return LinearizedPredictions(
        times=time_array,
        train=out.train,
        test=out.test,
        lambda_min=float("nan"),
        lambda_max=lambda_max,
        frozen_modes=0,
        tol=float("nan"),
        path=out.path,
        max_learning_rate=limit,
        solves=out.solves,
    )
