"""The old home of the engine's problem preparation, split into noun modules (issue 30); kept for one release so
imports of ``ntk_service.kernels.functional`` keep working. New code imports from the modules of ``kernels/problem/``:

- ``problem/problem.py``: ``NtkProblem``, the prepared model;
- ``problem/private_module.py``: ``check_model``, ``private_copy``, ``eval_semantics`` (NOTE [private module]);
- ``problem/parameter_selection.py``: ``select_parameters``;
- ``problem/inputs.py``: ``validate_inputs`` (tensors, and tuples or mappings of them through ``problem/batch.py``);
- ``problem/probe.py``: ``probe_model`` and ``PROBE_EXAMPLES``;
- ``problem/preparation.py``: ``prepare_problem``, ``build_problem``.
"""

from __future__ import annotations

from ntk_service.kernels.problem.inputs import validate_inputs
from ntk_service.kernels.problem.parameter_selection import select_parameters
from ntk_service.kernels.problem.preparation import build_problem, prepare_problem
from ntk_service.kernels.problem.private_module import check_model, eval_semantics, private_copy
from ntk_service.kernels.problem.probe import PROBE_EXAMPLES
from ntk_service.kernels.problem.problem import NtkProblem

__all__ = [
    "PROBE_EXAMPLES",
    "NtkProblem",
    "build_problem",
    "check_model",
    "eval_semantics",
    "prepare_problem",
    "private_copy",
    "select_parameters",
    "validate_inputs",
]
