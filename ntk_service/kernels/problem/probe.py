"""The probe: the model run once on a few examples, which checks that examples do not interact and measures the
output size k, the forward FLOPs per example ([FP]) and the bytes autograd saves for backward per example; the
planner turns those measurements into a cost and memory estimate."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.func import vmap
from torch.utils.flop_counter import FlopCounterMode

from ntk_service.errors import InvalidInput, ShapeMismatch, UnsupportedModel
from ntk_service.kernels.problem.batch import (
    Batch,
    batch_size,
    call_module,
    check_ids,
    embedding_feeds,
    is_batch,
    is_data_dependent,
    leaves,
    one_example,
)
from ntk_service.kernels.problem.math_attention import math_attention
from ntk_service.kernels.problem.outputs import select_output
from ntk_service.kernels.problem.problem import NtkProblem

__all__ = ["PROBE_EXAMPLES", "probe_model"]

PROBE_EXAMPLES = 4
"""Examples used to probe the model: enough to see examples interact, few enough to cost nothing."""


def _counted_forward(problem: NtkProblem, x: Batch) -> tuple[object, float, float, float]:
    """The model on the batch x, with its FLOPs and the bytes autograd saves for backward, per example.

    Returns:
        (output, FLOPs per example, saved bytes per example, bytes per example of the largest saved tensor); the
        output is detached.
    """
    saved = largest = 0
    # Weights autograd saves (e.g. for a matmul's input gradient) are shared by every example: not per-example bytes.
    shared = {t.untyped_storage().data_ptr() for t in (*problem.params.values(), *problem.frozen.values())}

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved, largest
        if t.untyped_storage().data_ptr() not in shared:
            size = t.numel() * t.element_size()
            saved += size
            largest = max(largest, size)
        return t

    params = {name: p.detach().requires_grad_(True) for name, p in problem.params.items()}
    counter = FlopCounterMode(display=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter:
        out = call_module(problem.module, (params, problem.frozen), x)
        if is_batch(x) or problem.output is not None:
            out = select_output(out, problem.output)
    n = batch_size(x)
    out = out.detach() if isinstance(out, torch.Tensor) else out
    return out, counter.get_total_flops() / n, saved / n, largest / n


def probe_model(problem: NtkProblem, x: Batch, sides: Sequence[tuple[str, Batch]] = ()) -> None:
    """Run the model on a few examples: output shape, examples independent, FLOPs and saved bytes counted.
    ``sides``: the whole batches (name, x) whose ids a failed probe checks, to name the leaf and example."""
    if is_batch(x):
        _probe_batch(problem, x, sides)
        return
    assert isinstance(x, torch.Tensor)
    n = x.shape[0]
    try:
        batched, problem.forward_flops, problem.saved_bytes, problem.largest_saved_bytes = _counted_forward(problem, x)
    except InvalidInput:
        raise
    except Exception as exc:  # the model's own error, e.g. a shape mismatch inside a layer
        sizes = sorted({m.num_embeddings for m in problem.module.modules() if isinstance(m, nn.Embedding)})
        if isinstance(exc, IndexError) and sizes and not x.is_floating_point():  # ids outside an Embedding's table
            tables = (
                f"a vocabulary of {sizes[0]} (ids 0..{sizes[0] - 1})" if len(sizes) == 1 else f"vocabularies {sizes}"
            )
            raise InvalidInput(
                f"compute_ntk: the model failed on token ids in [{int(x.min())}, {int(x.max())}] ({exc}); its "
                f"nn.Embedding has {tables}: send ids inside the vocabulary"
            ) from exc
        raise ShapeMismatch(
            f"compute_ntk: the model failed on inputs of per-example shape {tuple(x.shape[1:])} and dtype "
            f"{x.dtype}: {type(exc).__name__}: {exc}. Check the input shape the model expects"
        ) from exc
    if not isinstance(batched, torch.Tensor) or batched.ndim < 1 or batched.shape[0] != n:
        got = tuple(batched.shape) if isinstance(batched, torch.Tensor) else type(batched).__name__
        side, whole = sides[0] if sides else ("x1", x)
        shape = tuple(whole.shape) if isinstance(whole, torch.Tensor) else tuple(x.shape)
        raise UnsupportedModel(
            f"compute_ntk: {side} has shape {shape}, whose first dimension is the batch ({shape[0]} examples of "
            f"shape {shape[1:]}), but on the first {n} of them the model returned {got}, not a tensor (N, *out) with "
            f"one output row per example; if {shape} is one example, pass {side}.unsqueeze(0) (shape "
            f"{(1, *shape)}): inputs are batches (N, *input)"
        )
    problem.out_shape = tuple(batched.shape[1:])
    _check_independent(problem, x, batched, n)


def _probe_batch(problem: NtkProblem, x: Batch, sides: Sequence[tuple[str, Batch]]) -> None:
    """``probe_model`` for a tuple or mapping of inputs: also learns which integer leaf feeds which nn.Embedding
    (``problem.id_tables``), refusing a float leaf that feeds one."""
    n = batch_size(x)
    with embedding_feeds(problem.module, x) as feeds:
        try:
            batched, problem.forward_flops, problem.saved_bytes, problem.largest_saved_bytes = _counted_forward(
                problem, x
            )
        except InvalidInput:
            raise
        except Exception as exc:  # the model's own error, e.g. a missing argument or a shape mismatch in a layer
            feeds.check_floats()
            for side, whole in sides:
                check_ids(feeds.tables, whole, side)
            shown = ", ".join(f"{name or 'x'}: {tuple(t.shape[1:])} {t.dtype}" for name, t in leaves(x))
            if isinstance(exc, TypeError) and ("argument" in str(exc)):  # a missing or unexpected name
                raise InvalidInput(
                    f"compute_ntk: the model's forward does not take the inputs {shown} ({exc}); pass exactly the "
                    "arguments its forward takes, by position (a tuple) or by name (a mapping)"
                ) from exc
            raise ShapeMismatch(
                f"compute_ntk: the model failed on inputs {shown} (per-example shapes): {type(exc).__name__}: "
                f"{exc}. Check the input names, shapes and dtypes the model's forward expects"
            ) from exc
    feeds.check_floats()
    problem.id_tables = feeds.tables
    if not isinstance(batched, torch.Tensor) or batched.ndim < 1 or batched.shape[0] != n:
        got = tuple(batched.shape) if isinstance(batched, torch.Tensor) else type(batched).__name__
        raise UnsupportedModel(
            f"compute_ntk: for a batch of {n} examples the output {problem.output and problem.output.text!r} is "
            f"{got}; expected a tensor (N, *out) with one output row per example"
        )
    problem.out_shape = tuple(batched.shape[1:])
    _check_independent(problem, x, batched, n)


def _check_independent(problem: NtkProblem, x: Batch, batched: torch.Tensor, n: int) -> None:
    """The model one example at a time (``vmap``, or the per-example loop where vmap refuses the model's
    data-dependent control flow: NOTE [per-example loop]) agrees with the batch."""
    attention = math_attention()
    try:  # attention on its math path, as the implementations run it (the CPU flash kernel has no batching rule)
        with torch.no_grad(), attention:
            single = vmap(problem.f_single, (None, 0))(problem.params, x)
    except Exception as exc:
        if not is_data_dependent(exc):
            raise UnsupportedModel(
                f"compute_ntk: the model cannot be evaluated one example at a time under torch.func.vmap: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        attention = math_attention()  # vmap may refuse before any attention call: learn it from the loop
        with torch.no_grad(), attention:
            single = torch.stack([problem.f_single(problem.params, one_example(x, i)) for i in range(n)])
        problem.per_example_loop = True
    problem.calls_attention = attention.rerouted
    batched = batched.reshape(n, -1)
    scale = float(batched.abs().max()) + 1e-30
    tol = (1e-4 if problem.dtype == torch.float32 else 1e-9) * scale
    if n > 1 and float((batched - single).abs().max()) > tol:
        raise UnsupportedModel(
            "compute_ntk: the model's examples interact (its output for an example depends on the other examples "
            "in the batch, e.g. batch statistics or mixing across dim 0), so the per-example NTK is undefined"
        )
