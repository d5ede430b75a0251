"""What researchers compute from Θ: linearized training, GP inference, spectrum, alignment, kernel distance.

float64 numpy/scipy linear algebra on the kernels ``compute_ntk`` returns (numpy or torch, FULL (N, M, k, k) or
TRACE (N, M), the mode inferred from the rank), or on operators and stored kernels where only products or
tiles are needed (``solve``: the solver table behind ``solve_kernel`` and ``gp_inference``, CG, Nyström, Lanczos,
``estimate_ridge``). No HTTP, no SQL. The conventions that decide
whether numbers match (layout, the TRACE reading, losses and time scales, ridge, non-positive modes) are NOTEs in
``layout``, ``linearized``, ``ridge``, ``eigen`` and ``gp``, and docs/analysis.md.

    >>> theta = compute_ntk(model, x_train).theta                        # (N, N, k, k)  # doctest: +SKIP
    >>> as_matrix(theta).shape                                          # (N·k, N·k), row n·k + a
    >>> out = linearized_predictions(theta, y, times=[0, 100, math.inf], learning_rate=0.1)
    >>> out.train.shape                                                 # (3, N, k)
    >>> spectrum(theta, top=20).eigenvalues                             # (20,) descending
    >>> spectrum_memory_bytes(n * k, top=20)                            # its peak, checked before computing
    >>> alignment(theta, labels, variant="centered")                    # float
    >>> flin = linearize(model)                # an nn.Module: f0 + J(θ − θ0), train θ with any optimizer
    >>> cmp = compare_training(model, x, labels, loss=nn.CrossEntropyLoss(), steps=100)
    >>> cmp.train_gap.shape                                             # (101,)
"""

from __future__ import annotations

from ntk_service.analysis.alignment import Variant, alignment
from ntk_service.analysis.distance import distances_memory_bytes, kernel_distance, relative_change
from ntk_service.analysis.gp import GpPosterior, gp_inference
from ntk_service.analysis.layout import as_matrix
from ntk_service.analysis.lazy_training import TrainingComparison, compare_training
from ntk_service.analysis.linearize import TaylorExpansion, linearize, outputs_float64, taylor_expand
from ntk_service.analysis.linearized import (
    Flow,
    LinearizedPredictions,
    Loss,
    linearized_memory_bytes,
    linearized_predictions,
    loss_scale,
    max_learning_rate,
)
from ntk_service.analysis.ridge import RidgeScale
from ntk_service.analysis.solve import (
    CgOptions,
    HeldOut,
    SolveResult,
    SolverOptions,
    SolverResult,
    estimate_ridge,
    solve_kernel,
)
from ntk_service.analysis.spectrum import Method, Spectrum, spectrum, spectrum_memory_bytes, stored_kernel_operator
from ntk_service.analysis.tiles import KernelTile

__all__ = [
    "CgOptions",
    "Flow",
    "GpPosterior",
    "HeldOut",
    "KernelTile",
    "LinearizedPredictions",
    "Loss",
    "Method",
    "RidgeScale",
    "SolveResult",
    "SolverOptions",
    "SolverResult",
    "Spectrum",
    "TaylorExpansion",
    "TrainingComparison",
    "Variant",
    "alignment",
    "as_matrix",
    "compare_training",
    "distances_memory_bytes",
    "estimate_ridge",
    "gp_inference",
    "kernel_distance",
    "linearize",
    "linearized_memory_bytes",
    "linearized_predictions",
    "loss_scale",
    "max_learning_rate",
    "outputs_float64",
    "relative_change",
    "solve_kernel",
    "spectrum",
    "spectrum_memory_bytes",
    "stored_kernel_operator",
    "taylor_expand",
]
