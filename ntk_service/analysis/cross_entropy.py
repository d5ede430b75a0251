"""Cross-entropy training of the linearized network, in function space: what ``loss="cross_entropy"`` computes.

NOTE [cross-entropy dynamics]
    With class indices y (N,) and ``nn.CrossEntropyLoss()`` (mean over the N examples),
    L(f) = (1/N) Σ_n [logsumexp(f_n) − f_n[y_n]] and ∇_f L = (softmax(f) − onehot(y)) / N, an (N, k) array.
    The linearized network f_lin = f0 + J(θ − θ0) trained by θ ← θ − η ∇_θ L = θ − η Jᵀ ∇_f L moves its outputs
    by f ← f − η Θ vec(∇_f L) on the training inputs and f* ← f* − η Θ* vec(∇_f L) on the test inputs, exactly
    (f_lin is linear in θ): ``flow="gradient_descent"`` iterates that for integer step counts. Gradient flow,
    df/dt = −η Θ ∇_f L(f), has no closed form; ``flow="gradient_flow"`` integrates train and test outputs
    together with ``scipy.integrate.solve_ivp`` (DOP853) at the stated rtol / atol, which the result reports.
    Θ is the FULL (N·k, N·k) matrix, or a TRACE kernel read as (trace / k) ⊗ I_k (NOTE [layout]), which acts on
    the (N, k) gradient as the (N, N) matrix trace / k applied to each column. There is no t = ∞ (the loss has
    no minimizer on separable data: the logits grow without bound), so ``inf`` is refused.

    Step size: the loss's Hessian in f is (1/N)·blockdiag(diag(p) − ppᵀ), whose norm is at most 1/(2N), so
    L(θ) is (λmax / 2N)-smooth and every η < 4N / λmax decreases it (the descent lemma). That bound is reported
    as ``max_learning_rate``; larger steps are not refused (cross-entropy is not quadratic: they may still
    converge).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.integrate import solve_ivp

from ntk_service._tensors import is_torch_tensor
from ntk_service.analysis.blas_guard import large_matrix_blas
from ntk_service.analysis.layout import to_kernel_matrix, to_targets
from ntk_service.analysis.ridge import RidgeScale, ridge_value
from ntk_service.analysis.solve.krylov import operator_lambda_max
from ntk_service.analysis.solve.operators import KernelOperator, kernel_operator
from ntk_service.errors import InvalidInput, ResourceLimit, ShapeMismatch
from ntk_service.kernels.modes import KernelMode

__all__ = [
    "DEFAULT_ATOL",
    "DEFAULT_RTOL",
    "MAX_DESCENT_WORK",
    "CrossEntropyDynamics",
    "check_cross_entropy_plan",
    "class_indices",
    "cross_entropy_dynamics",
    "cross_entropy_on_operator",
]

DEFAULT_RTOL = 1e-10
"""solve_ivp's relative tolerance: float64 ODE results to ~1e-9, far below any difference a network shows."""

DEFAULT_ATOL = 1e-12
"""solve_ivp's absolute tolerance on logits of order one."""

MAX_DESCENT_WORK = 10**11
"""Multiply-adds a gradient-descent request (steps · (N+M)·k · N·k) or a gradient-flow solve (evaluations · the
same) may cost: ~10 minutes on two cores at the machine's float64 matrix-vector rate."""

_OPERATION = "linearized_predictions"


@dataclass(frozen=True)
class CrossEntropyDynamics:
    """Outputs of the linearized network trained on cross-entropy (NOTE [cross-entropy dynamics]).

    Attributes:
        times: (T,) as asked. train: (T, N, k) logits. test: (T, M, k) or None.
        lambda_min, lambda_max: extreme eigenvalues of the training kernel as used (after ridge; TRACE / k).
        max_learning_rate: 4N / λmax, the descent-lemma bound (not a refusal threshold).
        path: how it was computed. rtol, atol: the ODE solver's tolerances (None for gradient descent).
    """

    times: np.ndarray
    train: np.ndarray
    test: np.ndarray | None
    lambda_min: float
    lambda_max: float
    max_learning_rate: float
    path: str
    rtol: float | None
    atol: float | None


def class_indices(y: Any, *, n: int | None, k: int | None, name: str, operation: str) -> np.ndarray:
    """Class indices as an int64 (N,) array in [0, k).

    Args:
        y: integers, (N,) (numpy, torch or a list). n: examples expected (None: any). k: classes (None: no
            upper check).

    Raises:
        InvalidInput: a float or bool dtype (class probabilities are not supported), an index out of range.
        ShapeMismatch: not (N,).
    """
    if is_torch_tensor(y):
        y = y.detach().cpu().numpy()
    array = np.asarray(y)
    if array.dtype.kind not in "iu":
        raise InvalidInput(
            f"{operation}: {name} must hold integer class indices for loss='cross_entropy', got dtype "
            f"{array.dtype}; send int64 labels in [0, k) (class probabilities are not supported)"
        )
    if array.ndim != 1 or (n is not None and array.shape[0] != n):
        expected = f"({n},)" if n is not None else "(N,)"
        raise ShapeMismatch(
            f"{operation}: {name} has shape {array.shape}; loss='cross_entropy' takes one class index per "
            f"training example, shape {expected}"
        )
    if array.size and (array.min() < 0 or (k is not None and array.max() >= k)):
        bad = int(array.min()) if array.min() < 0 else int(array.max())
        raise InvalidInput(
            f"{operation}: {name} holds class index {bad}, outside [0, {k}); the model has k = {k} outputs, "
            "one logit per class"
        )
    return array.astype(np.int64)


def check_cross_entropy_plan(
    times: np.ndarray | list[float], flow: str, *, n: int, m: int, k: int, full: bool, operation: str
) -> None:
    """Refuse, before any kernel is computed, what the cross-entropy dynamics cannot do or would take too long.

    Args:
        times: the times or step counts asked for. flow: "gradient_descent" | "gradient_flow".
        n, m, k: training examples, test examples, classes. full: a FULL kernel (else TRACE).

    Raises:
        InvalidInput: ``inf`` among the times (no t = ∞ limit). ResourceLimit: gradient descent whose cost
        (steps · (N+M)·k · N·k multiply-adds for FULL, steps · (N+M)·N·k for TRACE) exceeds MAX_DESCENT_WORK.
    """
    array = np.asarray(times, dtype=np.float64)
    if np.any(np.isinf(array)):
        raise InvalidInput(
            f"{operation}: loss='cross_entropy' has no t = inf limit (the logits grow without bound on "
            "separable data); give finite times"
        )
    if flow != "gradient_descent" or array.size == 0:
        return
    last = int(array.max())
    work = last * (n + m) * n * k * (k if full else 1)
    if work > MAX_DESCENT_WORK:
        raise ResourceLimit(
            f"{operation}: {last} steps of gradient descent cost ~{work:.3g} multiply-adds, above the limit "
            f"{MAX_DESCENT_WORK:.3g}; ask for fewer steps, or use flow='gradient_flow' (its time t counts steps "
            "of size learning_rate, and its cost grows only slowly with t)"
        )


def _softmax_gradient(logits: np.ndarray, onehot: np.ndarray) -> np.ndarray:
    """∇_f of nn.CrossEntropyLoss() (mean over N): (softmax(f) − onehot(y)) / N, shape (N, k)."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(shifted)
    p /= p.sum(axis=1, keepdims=True)
    out: np.ndarray = (p - onehot) / logits.shape[0]
    return out


def cross_entropy_dynamics(
    k_train_train: Any,
    y_train: Any,
    *,
    times: np.ndarray,
    learning_rate: float,
    flow: str,
    k_test_train: Any = None,
    f0_train: Any = None,
    f0_test: Any = None,
    ridge: float = 0.0,
    ridge_scale: RidgeScale | str = "absolute",
    mode: KernelMode | str | None = None,
    n_classes: int | None = None,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
) -> CrossEntropyDynamics:
    """The cross-entropy branch of ``linearized_predictions`` (which checks ``times``, ``flow`` and η first).

    Args:
        k_train_train: (N, N, k, k) FULL or (N, N) TRACE. y_train: (N,) integer class indices in [0, k).
        times: (T,) checked step counts (gradient_descent) or times (gradient_flow); no ``inf``.
        learning_rate: η of SGD on ``nn.CrossEntropyLoss()``. flow: "gradient_descent" | "gradient_flow".
        k_test_train, f0_train, f0_test, ridge, ridge_scale, mode: as ``linearized_predictions``.
        n_classes: k for a TRACE kernel when neither f0_train nor f0_test gives it. Default: None.
        rtol, atol: solve_ivp's tolerances for gradient flow. Default: 1e-10, 1e-12.

    Returns:
        CrossEntropyDynamics: train (T, N, k) and test (T, M, k) logits.

    Raises:
        InvalidInput: non-integer or out-of-range labels, ``inf`` in times, a TRACE kernel with no way to know k.
        ShapeMismatch: kernels and outputs that do not fit together. ResourceLimit: gradient descent whose cost
        exceeds MAX_DESCENT_WORK (the message gives the estimate).

    Cost: one eigvalsh, O((N·k)³); gradient descent (N+M)·k·N·k per step; gradient flow the same per solver
    evaluation (a few hundred for logits of order ten).
    """
    k_out = _width(f0_train, f0_test, n_classes)
    kernel = to_kernel_matrix(
        k_train_train,
        name="k_train_train",
        operation=_OPERATION,
        mode=mode,
        square=True,
        symmetrize=True,
        trace_outputs=k_out,
    )
    n = kernel.n
    k = kernel.k if kernel.k is not None else k_out
    if k is None:
        raise InvalidInput(
            f"{_OPERATION}: a TRACE kernel does not say how many classes there are, and class indices do not "
            "either; pass f0_train of shape (N, k) (the model's outputs at initialization)"
        )
    labels = class_indices(y_train, n=n, k=k, name="y_train", operation=_OPERATION)
    f0 = np.zeros((n, k)) if f0_train is None else to_targets(f0_train, n=n, k=k, name="f0_train", operation=_OPERATION)
    matrix = kernel.matrix
    matrix[np.diag_indices_from(matrix)] += ridge_value(matrix, ridge, ridge_scale, operation=_OPERATION)
    with large_matrix_blas(matrix.shape[0]):  # NOTE [large blas]
        eigenvalues = np.linalg.eigvalsh(matrix)
    lambda_min, lambda_max = float(eigenvalues[0]), float(eigenvalues[-1])
    test_matrix, f0_star = _test_side(k_test_train, f0_test, kernel.mode, n=n, k=k, mode=mode)
    full = kernel.mode is KernelMode.FULL
    m = 0 if f0_star is None else f0_star.shape[0]
    check_cross_entropy_plan(times, flow, n=n, m=m, k=k, full=full, operation=_OPERATION)
    # One stacked operator [Θ; Θ*]: FULL ((N+M)·k, N·k) on vec(∇), TRACE (N+M, N) on the (N, k) gradient.
    stacked = matrix if test_matrix is None else np.vstack([matrix, test_matrix])
    onehot = np.eye(k)[labels]
    start = f0 if f0_star is None else np.vstack([f0, f0_star])

    def velocity(state: np.ndarray) -> np.ndarray:
        """d(outputs)/dt for (N+M, k) outputs: −η [Θ; Θ*] ∇_f L(f_train)."""
        grad = _softmax_gradient(state[:n], onehot)
        moved = stacked @ grad.reshape(n * k) if full else stacked @ grad
        out: np.ndarray = -learning_rate * moved.reshape(n + m, k)
        return out

    if flow == "gradient_descent":
        outputs, path = _descend(velocity, start, times)
        rtol_used: float | None = None
        atol_used: float | None = None
    else:
        work = (n + m) * n * k * (k if full else 1)  # multiply-adds of one evaluation
        outputs, path = _integrate(
            velocity, start, times, rtol=rtol, atol=atol, max_evaluations=max(1, MAX_DESCENT_WORK // work)
        )
        rtol_used, atol_used = rtol, atol
    return CrossEntropyDynamics(
        times=times,
        train=outputs[:, :n],
        test=None if f0_star is None else outputs[:, n:],
        lambda_min=lambda_min,
        lambda_max=lambda_max,
        max_learning_rate=math.inf if lambda_max <= 0 else 4.0 * n / lambda_max,
        path=f"cross_entropy {path}; Θ {matrix.shape[0]}x{matrix.shape[0]}",
        rtol=rtol_used,
        atol=atol_used,
    )


def _width(f0_train: Any, f0_test: Any, n_classes: int | None) -> int | None:
    for value in (f0_train, f0_test):
        shape = getattr(value, "shape", None) if value is not None else None
        if shape is None and value is not None:
            shape = np.shape(value)
        if shape is not None and len(shape) == 2:
            return int(shape[1])
    return n_classes


def _test_side(
    k_test_train: Any, f0_test: Any, train_mode: KernelMode, *, n: int, k: int, mode: KernelMode | str | None
) -> tuple[np.ndarray | None, np.ndarray | None]:
    if k_test_train is None:
        if f0_test is not None:
            raise InvalidInput(f"{_OPERATION}: f0_test was given without k_test_train; pass both or neither")
        return None, None
    test = to_kernel_matrix(k_test_train, name="k_test_train", operation=_OPERATION, mode=mode, trace_outputs=k)
    if test.mode is not train_mode or test.m != n or (test.k is not None and test.k != k):
        raise ShapeMismatch(
            f"{_OPERATION}: k_test_train has shape {np.shape(k_test_train)} ({test.mode.value}); with "
            f"k_train_train a {train_mode.value} kernel of {n} examples and k = {k}, pass Θ(x_test, x_train) of "
            f"shape (M, {n}{f', {k}, {k}' * (train_mode is KernelMode.FULL)}) in the same mode"
        )
    f0_star = (
        np.zeros((test.n, k))
        if f0_test is None
        else to_targets(f0_test, n=test.n, k=k, name="f0_test", operation=_OPERATION)
    )
    return test.matrix, f0_star


def _descend(velocity: Any, start: np.ndarray, times: np.ndarray) -> tuple[np.ndarray, str]:
    """The exact iterate f_{s+1} = f_s + velocity(f_s), recorded at the asked step counts."""
    steps = times.astype(np.int64)
    last = int(steps.max())
    wanted: dict[int, list[int]] = {}
    for i, s in enumerate(steps):
        wanted.setdefault(int(s), []).append(i)
    outputs = np.empty((times.size, *start.shape))
    state = start.copy()
    for s in range(last + 1):
        for i in wanted.get(s, ()):
            outputs[i] = state
        if s < last:
            state = state + velocity(state)
    return outputs, f"gradient_descent: {last} exact function-space steps"


class _TooManyEvaluations(Exception):
    """Raised inside solve_ivp's right-hand side to stop a run past its work limit."""


def _integrate(
    velocity: Any, start: np.ndarray, times: np.ndarray, *, rtol: float, atol: float, max_evaluations: int
) -> tuple[np.ndarray, str]:
    """solve_ivp (DOP853) of d(outputs)/dt = velocity, evaluated at the asked times.

    Its cost grows only like log t on separable data (the flow slows as the logits grow; ~1,100 evaluations to
    t = 10⁶ at N = 20, k = 3), but an explicit solver's step is bounded by the flow's stiffness, so a run is
    stopped after ``max_evaluations`` (MAX_DESCENT_WORK's worth) rather than left to run for hours.

    Raises:
        ResourceLimit: the solver needed more than ``max_evaluations`` evaluations.
    """
    count = [0]

    def rhs(_t: float, flat: np.ndarray) -> np.ndarray:
        count[0] += 1
        if count[0] > max_evaluations:
            raise _TooManyEvaluations
        out: np.ndarray = velocity(flat.reshape(start.shape)).reshape(-1)
        return out

    order = np.unique(times)
    outputs = np.empty((times.size, *start.shape))
    horizon = float(order[-1])
    if horizon == 0.0:
        outputs[:] = start
        return outputs, "gradient_flow: t = 0 only"
    try:
        solution = solve_ivp(
            rhs, (0.0, horizon), start.reshape(-1), method="DOP853", t_eval=order, rtol=rtol, atol=atol
        )
    except _TooManyEvaluations:
        raise ResourceLimit(
            f"{_OPERATION}: the ODE solver of the cross-entropy flow needed more than {max_evaluations} evaluations "
            f"(~{MAX_DESCENT_WORK:.3g} multiply-adds) to reach t = {horizon:g}; ask for smaller times or a smaller "
            "learning_rate"
        ) from None
    if not solution.success:  # pragma: no cover - DOP853 on this smooth, non-stiff flow has not failed here
        raise InvalidInput(f"{_OPERATION}: the ODE solver failed ({solution.message}); try smaller times")
    by_time = {float(t): solution.y[:, j].reshape(start.shape) for j, t in enumerate(solution.t)}
    for i, t in enumerate(times):
        outputs[i] = by_time[float(t)]
    return outputs, f"gradient_flow: solve_ivp DOP853, rtol={rtol:g}, atol={atol:g}, {solution.nfev} evaluations"


def cross_entropy_on_operator(
    k_train_train: Any,
    y_train: Any,
    *,
    times: np.ndarray,
    learning_rate: float,
    flow: str,
    k_test_train: Any = None,
    f0_train: Any = None,
    f0_test: Any = None,
    ridge: float = 0.0,
    ridge_scale: RidgeScale | str = "absolute",
    mode: KernelMode | str | None = None,
    n_classes: int | None = None,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
) -> CrossEntropyDynamics:
    """The cross-entropy dynamics of ``cross_entropy_dynamics`` with Θ (and Θ*) given as operators.

    The velocity −η [Θ; Θ*] ∇_f L needs only products, so it runs through ``KernelOperator.apply`` (NOTE [operator
    layout]: FULL (N·k, N·k) on vec(∇), TRACE (N, N) read as (trace / k) ⊗ I_k on the k columns of ∇). λmax comes
    from Lanczos (``operator_lambda_max``) for ``max_learning_rate``; λmin is not computed and is reported as NaN.
    The work bound MAX_DESCENT_WORK is counted in operator products, each charged its dense size (rows · cols
    multiply-adds per column), the same count as the dense path's.

    Args:
        k_train_train: an operator (``NtkOperator``, SciPy ``LinearOperator``, or shape + matvec) of shape
            (N·k, N·k) FULL or (N, N) TRACE. y_train: (N,) integer class indices in [0, k).
        times, learning_rate, flow, f0_train, f0_test, mode, rtol, atol: as ``cross_entropy_dynamics``.
        k_test_train: (M·k, N·k) or (M, N) operator (or a dense kernel) in the training kernel's mode, or None.
        ridge: absolute λ added to Θ. ridge_scale: must be "absolute" (an operator's diagonal is unknown).
        n_classes: k when neither f0_train, f0_test nor the operator (an ``NtkOperator``'s ``k``) gives it.

    Returns:
        CrossEntropyDynamics: train (T, N, k), test (T, M, k) or None; lambda_min NaN; path names the operator.

    Raises:
        InvalidInput: a relative ridge, labels or times as ``cross_entropy_dynamics`` refuses them, k unknown.
        ShapeMismatch: operators whose shapes do not fit the labels, k or each other.
        ResourceLimit: more work than MAX_DESCENT_WORK (the message gives the estimate).
    """
    k = _width(f0_train, f0_test, n_classes)
    if k is None:
        own = getattr(k_train_train, "k", None)
        k = int(own) if own is not None else None
    if k is None:
        raise InvalidInput(
            f"{_OPERATION}: an operator does not say how many classes there are, and class indices do not either; "
            "pass f0_train of shape (N, k) (the model's outputs at initialization)"
        )
    labels = class_indices(y_train, n=None, k=k, name="y_train", operation=_OPERATION)
    n = labels.shape[0]
    if ridge_scale != "absolute":
        raise InvalidInput(
            f"{_OPERATION}: ridge_scale={ridge_scale!r} on an operator: its diagonal is unknown; pass an absolute ridge"
        )
    lam = ridge_value(np.zeros((1, 1)), ridge, "absolute", operation=_OPERATION)
    train = kernel_operator(k_train_train, k=k, name="k_train_train", operation=_OPERATION, rows=n, cols=n, mode=mode)
    f0 = np.zeros((n, k)) if f0_train is None else to_targets(f0_train, n=n, k=k, name="f0_train", operation=_OPERATION)
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
    full = train.mode is KernelMode.FULL
    m = 0 if f0_star is None else f0_star.shape[0]
    check_cross_entropy_plan(times, flow, n=n, m=m, k=k, full=full, operation=_OPERATION)
    lambda_max = operator_lambda_max(train, ridge=lam)
    onehot = np.eye(k)[labels]
    start = f0 if f0_star is None else np.vstack([f0, f0_star])
    products = [0]

    def apply(op: KernelOperator, grad: np.ndarray) -> np.ndarray:
        block = grad.reshape(n * k, 1) if full else grad
        products[0] += block.shape[1]
        out: np.ndarray = op.apply(block).reshape(op.n, k)
        return out

    def velocity(state: np.ndarray) -> np.ndarray:
        """d(outputs)/dt for (N+M, k) outputs: −η [Θ + λI; Θ*] ∇_f L(f_train), by operator products."""
        grad = _softmax_gradient(state[:n], onehot)
        moved = apply(train, grad) + lam * grad
        if cross is not None:
            moved = np.vstack([moved, apply(cross, grad)])
        out: np.ndarray = -learning_rate * moved
        return out

    if flow == "gradient_descent":
        outputs, path = _descend(velocity, start, times)
        rtol_used: float | None = None
        atol_used: float | None = None
    else:
        work = (n + m) * n * k * (k if full else 1)  # multiply-adds charged per evaluation (its products' dense size)
        outputs, path = _integrate(
            velocity, start, times, rtol=rtol, atol=atol, max_evaluations=max(1, MAX_DESCENT_WORK // work)
        )
        rtol_used, atol_used = rtol, atol
    return CrossEntropyDynamics(
        times=times,
        train=outputs[:, :n],
        test=None if f0_star is None else outputs[:, n:],
        lambda_min=float("nan"),
        lambda_max=lambda_max,
        max_learning_rate=math.inf if lambda_max <= 0 else 4.0 * n / lambda_max,
        path=(
            f"cross_entropy {path}; on a {train.mode.value} operator {train.rows}x{train.cols}, "
            f"{products[0]} operator products, λmax by Lanczos"
        ),
        rtol=rtol_used,
        atol=atol_used,
    )
