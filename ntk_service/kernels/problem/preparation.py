"""From an ``nn.Module`` and its inputs to an ``NtkProblem``: ``prepare_problem`` validates the inputs
(``inputs.py``), selects the parameters (``parameter_selection.py``), casts them to the compute dtype and probes the
model once (``probe.py``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ntk_service.kernels.problem.batch import Batch, batch_size, check_ids, concat, take, template
from ntk_service.kernels.problem.inputs import validate_inputs
from ntk_service.kernels.problem.outputs import OutputPath
from ntk_service.kernels.problem.parameter_selection import select_parameters
from ntk_service.kernels.problem.probe import PROBE_EXAMPLES, probe_model
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.types import NamedTensors

__all__ = ["build_problem", "prepare_problem"]


def prepare_problem(
    module: nn.Module,
    x1: object,
    x2: object | None,
    *,
    params: Sequence[str] | None,
    dtype: torch.dtype | str | None,
    output: OutputPath | None = None,
) -> tuple[NtkProblem, Batch, Batch | None]:
    """Validate inputs and build the NtkProblem, for the module yielded by ``eval_semantics``.

    Args:
        module: the model; a batch (N, *input) maps to (N, *out).
        x1: (N, *input) float or integer tensor (or anything ``torch.as_tensor`` takes).
        x2: (M, *input) or None.
        params: glob patterns over parameter names, or None for all.
        dtype: compute dtype (float32/float64, or their names); None = the model's floating dtype.
        output: which tensor of forward's return value is f (``outputs.parse_output``). Default: None.

    Returns:
        (problem, x1, x2): x1 (N, *input) and x2 (M, *input) or None, cast to the compute dtype when floating.

    Raises:
        ShapeMismatch, EmptyBatch, NonFiniteInput, NoMatchingParameters, UnsupportedModel.
    """
    compute_dtype, x1t, x2t = validate_inputs(module, x1, x2, dtype)
    return build_problem(module, x1t, x2t, params=params, dtype=compute_dtype, output=output), x1t, x2t


def build_problem(
    module: nn.Module,
    x1: Batch,
    x2: Batch | None,
    *,
    params: Sequence[str] | None,
    dtype: torch.dtype,
    output: OutputPath | None = None,
) -> NtkProblem:
    """Select and cast the parameters and probe the model on the first examples of x1 (then x2).

    Args:
        module: the model (a private copy, see NOTE [private module]).
        x1, x2: validated inputs (``validate_inputs``).
        params: glob patterns over parameter names, or None for all.
        dtype: the compute dtype.
        output: which tensor of forward's return value is f (``outputs.parse_output``). Default: None.
    """
    selected = select_parameters(module, params)
    all_params = dict(module.named_parameters())
    problem = NtkProblem(
        module=module,
        params=_cast_named(((n, all_params[n]) for n in selected), dtype),
        frozen={
            **_cast_named(((n, p) for n, p in all_params.items() if n not in set(selected)), dtype),
            **_cast_named(module.named_buffers(), dtype),
        },
        out_shape=(),
        input_shape=tuple(x1.shape[1:]) if isinstance(x1, torch.Tensor) else (),
        dtype=dtype,
        forward_flops=0.0,
        saved_bytes=0.0,
        output=output,
        template=None if isinstance(x1, torch.Tensor) else template(x1),
    )
    probe = take(x1, 0, PROBE_EXAMPLES)
    if x2 is not None and batch_size(probe) < PROBE_EXAMPLES:
        probe = concat(probe, take(x2, 0, PROBE_EXAMPLES - batch_size(probe)))
    sides = [("x1", x1)] if x2 is None else [("x1", x1), ("x2", x2)]
    probe_model(problem, probe, sides)
    for side, whole in sides:
        check_ids(problem.id_tables, whole, side)
    return problem


def _cast_named(tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype) -> NamedTensors:
    return {name: (t.detach().to(dtype) if t.is_floating_point() else t.detach()) for name, t in tensors}
