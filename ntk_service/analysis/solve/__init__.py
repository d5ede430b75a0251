"""Solvers of (Θ + λI) α = y on kernels seen densely or through products, in one table (``table.py``).

``solve_kernel(kernel, y, ridge=..., options=SolverOptions(solver="auto"))`` is the entry point; ``SOLVERS`` holds
"dense" (Cholesky), "pcg" (preconditioned block CG with an adaptive Nyström preconditioner), "block" (the
parameter-space block method) and "auto" (NOTE [auto rule] in ``table.py``). ``gp_inference`` and
``InverseOperator`` (a solver as an operator) go through the same table. Below them: CG itself
(``conjugate_gradients``), the Nyström preconditioners, Lanczos functions (``linearized_predictions`` at finite t,
``spectrum(bottom=...)``), and ``estimate_ridge`` (GCV and leave-one-out from a Nyström approximation). Every
kernel reaches them through ``kernel_operator`` (NOTE [operator layout] in ``operators.py``).
"""

from ntk_service.analysis.solve.adaptive_nystrom import adaptive_nystrom_preconditioner
from ntk_service.analysis.solve.block import DEFAULT_BLOCK_LANDMARKS, DEFAULT_BLOCK_SIZE, DEFAULT_INNER_STEPS
from ntk_service.analysis.solve.cg import (
    AUTO_NYSTROM_MIN_SIZE,
    DEFAULT_MAX_ITERATIONS,
    DEFAULT_METHOD,
    CgMethod,
    CgOptions,
    Preconditioner,
    SolveResult,
    cg_memory_bytes,
    conjugate_gradients,
)
from ntk_service.analysis.solve.inverse import InverseOperator
from ntk_service.analysis.solve.lanczos import LanczosResult, lanczos_functions
from ntk_service.analysis.solve.operators import KernelOperator, as_operator, check_ridge, is_operator, kernel_operator
from ntk_service.analysis.solve.preconditioners import (
    DEFAULT_LANDMARKS,
    LandmarkMethod,
    NystromPreconditioner,
    nystrom_preconditioner,
    shared_nystrom_preconditioner,
)
from ntk_service.analysis.solve.problem import (
    DEFAULT_RTOL,
    DEFAULT_RTOL_FLOAT32,
    Attempt,
    HeldOut,
    Progress,
    SolveProblem,
    SolverOptions,
    SolverResult,
    SolverState,
)
from ntk_service.analysis.solve.ridge_estimate import RidgeEstimate, estimate_ridge
from ntk_service.analysis.solve.streamed_nystrom import (
    DEFAULT_OVERSAMPLE,
    StreamedNystromPlan,
    plan_streamed_nystrom,
    streamed_nystrom_preconditioner,
)
from ntk_service.analysis.solve.table import (
    DENSE_MAX_ROWS,
    SOLVERS,
    AutoSolver,
    Solver,
    auto_order,
    make_problem,
    solve_kernel,
    solve_memory_bytes,
)

__all__ = [
    "AUTO_NYSTROM_MIN_SIZE",
    "DEFAULT_BLOCK_LANDMARKS",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_INNER_STEPS",
    "DEFAULT_LANDMARKS",
    "DEFAULT_MAX_ITERATIONS",
    "DEFAULT_METHOD",
    "DEFAULT_OVERSAMPLE",
    "DEFAULT_RTOL",
    "DEFAULT_RTOL_FLOAT32",
    "DENSE_MAX_ROWS",
    "SOLVERS",
    "Attempt",
    "AutoSolver",
    "CgMethod",
    "CgOptions",
    "HeldOut",
    "InverseOperator",
    "KernelOperator",
    "LandmarkMethod",
    "LanczosResult",
    "NystromPreconditioner",
    "Preconditioner",
    "Progress",
    "RidgeEstimate",
    "SolveProblem",
    "SolveResult",
    "Solver",
    "SolverOptions",
    "SolverResult",
    "SolverState",
    "StreamedNystromPlan",
    "adaptive_nystrom_preconditioner",
    "as_operator",
    "auto_order",
    "cg_memory_bytes",
    "check_ridge",
    "conjugate_gradients",
    "estimate_ridge",
    "is_operator",
    "kernel_operator",
    "lanczos_functions",
    "make_problem",
    "nystrom_preconditioner",
    "plan_streamed_nystrom",
    "shared_nystrom_preconditioner",
    "solve_kernel",
    "solve_memory_bytes",
    "streamed_nystrom_preconditioner",
]
