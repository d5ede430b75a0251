"""The old home of the engine's problem preparation, split into noun modules (issue 30); kept for one release so
imports of ``ntk_service.kernels.functional`` keep working. New code imports from the modules themselves:

- ``problem.py``: ``NtkProblem``, the prepared model;
- ``private_module.py``: ``check_model``, ``private_copy``, ``eval_semantics`` (NOTE [private module]);
- ``parameter_selection.py``: ``select_parameters``;
- ``inputs.py``: ``validate_inputs`` (tensors, and tuples or mappings of them through ``batch.py``);
- ``probe.py``: ``probe_model`` and ``PROBE_EXAMPLES``;
- ``preparation.py``: ``prepare_problem``, ``build_problem``.
"""

from __future__ import annotations

from ntk_service.kernels.inputs import validate_inputs
from ntk_service.kernels.parameter_selection import select_parameters
from ntk_service.kernels.preparation import build_problem, prepare_problem
from ntk_service.kernels.private_module import check_model, eval_semantics, private_copy
from ntk_service.kernels.probe import PROBE_EXAMPLES
from ntk_service.kernels.problem import NtkProblem

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
