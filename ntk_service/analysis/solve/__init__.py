"""Solvers on kernels seen through products: preconditioned (block) CG, Nyström preconditioners, Lanczos functions.

``gp_inference(solver="cg")``, ``linearized_predictions`` and ``max_learning_rate`` on operators, and
``spectrum(bottom=...)``, are built on these; they are public for a solve the analyses do not cover. Every kernel
reaches them through ``kernel_operator`` (NOTE [operator layout] in ``operators.py``).
"""

from ntk_service.analysis.solve.cg import (
    AUTO_NYSTROM_MIN_SIZE,
    DEFAULT_MAX_ITERATIONS,
    DEFAULT_METHOD,
    DEFAULT_RTOL,
    CgMethod,
    CgOptions,
    Preconditioner,
    SolveResult,
    cg_memory_bytes,
    conjugate_gradients,
)
from ntk_service.analysis.solve.lanczos import LanczosResult, lanczos_functions
from ntk_service.analysis.solve.operators import KernelOperator, check_ridge, is_operator, kernel_operator
from ntk_service.analysis.solve.preconditioners import (
    DEFAULT_LANDMARKS,
    LandmarkMethod,
    NystromPreconditioner,
    nystrom_preconditioner,
    shared_nystrom_preconditioner,
)
from ntk_service.analysis.solve.streamed_nystrom import (
    DEFAULT_OVERSAMPLE,
    StreamedNystromPlan,
    plan_streamed_nystrom,
    streamed_nystrom_preconditioner,
)

__all__ = [
    "AUTO_NYSTROM_MIN_SIZE",
    "DEFAULT_LANDMARKS",
    "DEFAULT_MAX_ITERATIONS",
    "DEFAULT_METHOD",
    "DEFAULT_OVERSAMPLE",
    "DEFAULT_RTOL",
    "CgMethod",
    "CgOptions",
    "KernelOperator",
    "LandmarkMethod",
    "LanczosResult",
    "NystromPreconditioner",
    "Preconditioner",
    "SolveResult",
    "StreamedNystromPlan",
    "cg_memory_bytes",
    "check_ridge",
    "conjugate_gradients",
    "is_operator",
    "kernel_operator",
    "lanczos_functions",
    "nystrom_preconditioner",
    "plan_streamed_nystrom",
    "shared_nystrom_preconditioner",
    "streamed_nystrom_preconditioner",
]
