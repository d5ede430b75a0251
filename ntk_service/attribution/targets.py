"""The output function and the loss-gradient weights of each example, from the model's outputs and the labels.

Influence of a training example n on a measurement m(x*) (Koh & Liang 2017; TRAK, Park et al. 2023): removing n
moves the parameters by H⁻¹∇ℓ_n to first order, so keeping it changes m by τ = ∇m(x*)ᵀ H⁻¹ (−∇ℓ_n). With J the
Jacobian of the outputs f (k per example), ∇ℓ_n = J_nᵀ ∂ℓ/∂f_n, and H is a Gauss-Newton matrix Σ_n G_nᵀ G_n + λI
over "Hessian rows" G_n = B_nᵀ J_n. Every quantity is a weighting of J's rows:

| loss | Hessian rows B_n (k × c) | −∂ℓ/∂f_n = B_n s_n | measurement weights u* (m = u*ᵀ f*) |
|---|---|---|---|
| cross_entropy | w_n = ∂margin_n/∂f (c = 1) | s_n = 1 − p_y (TRAK's Q) | w* of the test label (its margin) |
| mse | I_k (c = k: the exact Gauss-Newton of ½‖f − y‖²) | s_n = y_n − f_n | y* − f* (minus the test loss's gradient) |

Cross-entropy: TRAK's margin log(p_y / (1 − p_y)) = f_y − logsumexp_{a≠y} f_a has gradient w = e_y − q with
q_a = p_a / (1 − p_y) off y, and (1 − p_y)·w = e_y − p = −∂CE/∂f exactly, so the weighting is TRAK's "Q" and its
Hessian rows are TRAK's (the margin gradients; TRAK's rank-one stand-in for the softmax Gauss-Newton). A test
example without a label is measured at the model's predicted class.

Scores are then τ(x*, n) = ∇m(x*)ᵀ (GᵀG + λI)⁻¹ Σ_j s_{n,j} G_{n,j}ᵀ: positive when training on n raised the test
example's margin (or lowered its squared error): a proponent; negative: an opponent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ntk_service.attribution.options import AttributionLoss
from ntk_service.errors import InvalidInput, NonFiniteInput, ShapeMismatch

__all__ = ["OutputWeights", "check_labels", "measurement_weights", "train_weights"]


@dataclass(frozen=True)
class OutputWeights:
    """Per-example weights of the output rows, in float64.

    Attributes:
        rows: (N, k) weights w_n of the one Hessian row of each example (cross-entropy), or None: all k rows
            (mse, B_n = I).
        loss: (N,) s_n = 1 − p_y (cross-entropy) or (N, k) residuals y − f (mse).
    """

    rows: torch.Tensor | None
    loss: torch.Tensor


def check_labels(
    y: object, *, n: int, out_shape: tuple[int, ...], loss: AttributionLoss, name: str, operation: str
) -> torch.Tensor:
    """Labels as a tensor: class indices (n,) int64 for cross-entropy, targets (n, k) float64 for mse.

    Args:
        y: the labels as given (tensor, numpy array or nested lists).
        n: examples. out_shape: the model's per-example output shape (k = its product). loss: the loss.
        name: "y_train" or "y_test", for messages. operation: the public call, for messages.

    Raises:
        ShapeMismatch: labels of another shape (the message gives both). InvalidInput: float class indices,
            indices outside [0, k), cross-entropy on one output. NonFiniteInput: NaN or inf targets.
    """
    k = _prod(out_shape)
    try:
        t = torch.as_tensor(y)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidInput(f"{operation}: {name} must be an array of numbers, got {type(y).__name__} ({exc})") from exc
    if loss is AttributionLoss.CROSS_ENTROPY:
        if k < 2:
            raise InvalidInput(
                f"{operation}: loss='cross_entropy' needs at least 2 outputs (class logits), the model has k={k}; "
                "use loss='mse' for a scalar output"
            )
        if tuple(t.shape) != (n,):
            raise ShapeMismatch(
                f"{operation}: {name} has shape {tuple(t.shape)}, expected ({n},): one class index per example for "
                "loss='cross_entropy' (for one-hot or float targets use loss='mse')"
            )
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise InvalidInput(f"{operation}: {name} must hold integer class indices, got dtype {t.dtype}")
        t = t.to(torch.int64)
        if n and (int(t.min()) < 0 or int(t.max()) >= k):
            bad = int(((t < 0) | (t >= k)).nonzero()[0])
            raise InvalidInput(
                f"{operation}: {name}[{bad}] = {int(t[bad])} is not a class index in [0, {k}) of the model's {k} "
                "outputs"
            )
        return t
    if tuple(t.shape) not in ((n, *out_shape), (n, k)) and not (k == 1 and tuple(t.shape) == (n,)):
        raise ShapeMismatch(
            f"{operation}: {name} has shape {tuple(t.shape)}, expected {(n, *out_shape)}: one target per model output "
            "for loss='mse' (for class indices use loss='cross_entropy')"
        )
    if not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
        raise InvalidInput(f"{operation}: {name} must hold numbers, got dtype {t.dtype}")
    t = t.to(torch.float64).reshape(n, k)
    if not bool(torch.isfinite(t).all()):
        raise NonFiniteInput(f"{operation}: {name} contains NaN or inf; clean the targets")
    return t


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _margin(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w = ∂margin/∂f (N, k) and 1 − p_y (N,), in float64, stable for any logits."""
    f = logits.to(torch.float64)
    at_label = torch.nn.functional.one_hot(labels, f.shape[1]).bool()
    others = f.masked_fill(at_label, float("-inf"))
    q = torch.softmax(others, dim=1)  # p_a / (1 − p_y) off the label, 0 at it
    one_minus_p = torch.exp(torch.logsumexp(others, dim=1) - torch.logsumexp(f, dim=1))
    return at_label.to(torch.float64) - q, one_minus_p


def train_weights(outputs: torch.Tensor, y: torch.Tensor, loss: AttributionLoss) -> OutputWeights:
    """The Hessian rows and loss weights of training examples (module docstring's table).

    Args:
        outputs: (N, k) the model's outputs at the checkpoint. y: labels from ``check_labels``. loss: the loss.

    Returns:
        OutputWeights: rows (N, k) or None; loss (N,) or (N, k), float64.
    """
    if loss is AttributionLoss.CROSS_ENTROPY:
        w, one_minus_p = _margin(outputs, y)
        return OutputWeights(rows=w, loss=one_minus_p)
    return OutputWeights(rows=None, loss=y - outputs.to(torch.float64))


def measurement_weights(outputs: torch.Tensor, y: torch.Tensor | None, loss: AttributionLoss) -> torch.Tensor:
    """u* (M, k) float64: the measurement of each test example is u*ᵀ f* to first order (module docstring).

    Args:
        outputs: (M, k) the model's outputs. y: labels from ``check_labels``, or None for cross-entropy (the
            predicted class). loss: the loss.

    Raises:
        InvalidInput: mse without targets.
    """
    if loss is AttributionLoss.CROSS_ENTROPY:
        labels = outputs.argmax(dim=1) if y is None else y
        return _margin(outputs, labels)[0]
    if y is None:
        raise InvalidInput("attribution: loss='mse' measures the test loss, so y_test (M, *out) targets are required")
    return y - outputs.to(torch.float64)
