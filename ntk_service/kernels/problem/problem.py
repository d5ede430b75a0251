"""``NtkProblem``: a model prepared for the kernel engine, the per-example function f(params, x) -> (k,) that every
implementation differentiates, with what the probe measured (``probe.py``) and what the planner keeps.

Built by ``preparation.prepare_problem`` (or kept by ``problem_pool``).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from ntk_service.kernels.problem.batch import Batch, IdTables, batch_size, call_module, unsqueeze
from ntk_service.kernels.problem.outputs import OutputPath, select_output
from ntk_service.kernels.types import NamedTensors

__all__ = ["NtkProblem", "as_outputs"]


@dataclass
class NtkProblem:
    """A model prepared for kernel computation; all tensors are in the compute dtype.

    Attributes:
        module: a private structural copy of the user's module (NOTE [private module]), or the user's own under
            a lock when it cannot be copied; never mutated beyond ``functional_call``'s temporary swap.
        params: the selected parameters, detached, by name (tied weights appear once).
        frozen: every other parameter and buffer, detached, by name (constants of f).
        out_shape: per-example output shape; k = prod(out_shape).
        input_shape: per-example input shape; () for a tuple or mapping of inputs (``batch.py``).
        dtype: the compute dtype (float32 or float64).
        forward_flops: FLOPs of one example's forward pass, counted by ``FlopCounterMode``.
        saved_bytes: bytes autograd saves for backward in one example's forward pass.
        largest_saved_bytes: bytes of one example's share of the largest tensor autograd saves (0: not probed).
        owns_module: ``module`` is a private copy (``problem_pool``) whose own parameters and buffers hold the
            values of ``params`` and ``frozen`` (same storage and dtype), so ``f_own`` may call it directly.
        choices: the implementation and block plan chosen per call shape (``choice.choose``), kept with the
            problem so a kept problem (``problem_pool``) plans once per shape.
        analyses: an implementation's one-off analysis of the model, kept with the problem by a key of its own
            (the structured engine's frozen plan per options: ``structured.Structured.terms``).
        output: which tensor of forward's return value is f (``outputs.py``); None: forward returns it.
        per_example_loop: ``vmap`` over examples is refused by the model (data-dependent control flow, e.g. a
            Hugging Face attention mask's ``padding_mask.all()``), so the Jacobians are built one example at a time
            (NOTE [per-example loop]).
        id_tables: integer leaf name -> the nn.Embedding it feeds and its size, seen by the probe: every
            example's ids are checked against it on every call (``batch.check_ids``).
        template: for a tuple or mapping of inputs, one example of their shapes and dtypes, for analyses made
            before any data (``batch.template``; the structured plan); None for a tensor (``input_shape``).
        calls_attention: the probe saw the model call ``F.scaled_dot_product_attention`` (or MultiheadAttention's
            functional form) itself, without an attention module (Hugging Face models): run it on the math path
            wherever examples are vmapped (``math_attention.attention_scope``).
    """

    module: nn.Module
    params: NamedTensors
    frozen: NamedTensors
    out_shape: tuple[int, ...]
    input_shape: tuple[int, ...]
    dtype: torch.dtype
    forward_flops: float
    saved_bytes: float
    largest_saved_bytes: float = 0.0
    owns_module: bool = False
    choices: dict[Hashable, Any] = field(default_factory=dict)
    analyses: dict[Hashable, Any] = field(default_factory=dict)
    output: OutputPath | None = None
    per_example_loop: bool = False
    id_tables: IdTables = field(default_factory=dict)
    template: Batch | None = None
    calls_attention: bool = False

    @property
    def k(self) -> int:
        return math.prod(self.out_shape)

    @property
    def num_params(self) -> int:
        """P: the number of selected scalar parameters."""
        return sum(p.numel() for p in self.params.values())

    @property
    def itemsize(self) -> int:
        return torch.finfo(self.dtype).bits // 8

    def f_batch(self, params: NamedTensors, x: Batch) -> torch.Tensor:
        """The model on a batch: x (n, *input) (or a tuple/mapping of such leaves) -> (n, k)."""
        if isinstance(x, torch.Tensor) and self.output is None:
            out: torch.Tensor = functional_call(self.module, (params, self.frozen), (x,))
        else:
            out = select_output(call_module(self.module, (params, self.frozen), x), self.output)
        return as_outputs(out, batch_size(x), self.k)

    def f_own(self, x: Batch) -> torch.Tensor:
        """``f_batch(self.params, x)`` without ``functional_call``'s swapping, when ``owns_module``.

        The module's own parameters take part (they require grad): fine for differentiating w.r.t. anything else
        (the structured capture's probes), wrong for telling parameter uses apart (``plan_structure`` tracks the
        tensors of ``params``, so it calls ``f_batch``).
        """
        if not self.owns_module:
            return self.f_batch(self.params, x)
        if isinstance(x, torch.Tensor):
            raw: object = self.module(x)
        else:
            raw = self.module(*x) if isinstance(x, tuple) else self.module(**x)
        return as_outputs(select_output(raw, self.output), batch_size(x), self.k)

    def f_single(self, params: NamedTensors, x: Batch) -> torch.Tensor:
        """The model on one example: x (*input) -> (k,). Use under ``vmap`` for batches."""
        return self.f_batch(params, unsqueeze(x)).squeeze(0)


def as_outputs(out: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The model's output as (n, k); the model's own tensor when it has that shape already (not a view of it), so
    the structured capture can tell which layer's output the model returned (``Recorder.output_use``)."""
    return out if out.shape == (n, k) else out.reshape(n, k)
