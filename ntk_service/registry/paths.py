"""The path report of a registered model (``kernels.paths.describe_paths``), made once at registration on example
inputs of the model's own input contract and kept with the model (it depends on the architecture, not on the
weights of a version).

    >>> model_paths(module, spec, architecture, operation="register 'm'")
    {"capture": "batched: ...", "auto": {"implementation": "structured", ...}, "groups": [...], ...}

A model the engine cannot describe on those examples (its forward fails on them, its examples interact) gets
``{"error": message}``: registration never fails for the report's sake, and every kernel request checks the model
again on its own inputs.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ntk_service.errors import NtkServiceError
from ntk_service.kernels.paths import describe_paths
from ntk_service.registry.records import InputSpec
from ntk_service.registry.zoo import ModelSpec

__all__ = ["REPORT_EXAMPLES", "model_paths", "report_inputs"]

logger = logging.getLogger(__name__)

REPORT_EXAMPLES = 2
"""Examples the report runs the model on: two different ones, on which the engine learns how a batched forward
keeps them apart."""


def _leaf(shape: tuple[int, ...], dtype: str, vocab: int | None, generator: torch.Generator) -> torch.Tensor:
    full = (REPORT_EXAMPLES, *shape)
    if dtype == "float32":
        return torch.randn(full, generator=generator)
    if vocab is None:  # an integer input no embedding reads (a mask): ones attend
        return torch.ones(full, dtype=torch.int64)
    ids = torch.arange(REPORT_EXAMPLES, dtype=torch.int64).view(-1, *(1,) * len(shape)) % max(vocab, 1)
    return ids.expand(full).contiguous()  # example i holds id i everywhere: valid ids, different examples


def report_inputs(spec: ModelSpec, architecture: dict[str, Any], inputs: InputSpec | None) -> Any:
    """``REPORT_EXAMPLES`` different examples of the model's input(s): a tensor, or a dict/tuple of them."""
    generator = torch.Generator().manual_seed(0)
    if inputs is None:
        vocab = architecture.get("vocab_size")
        return _leaf(tuple(spec.input_shape), spec.input_dtype, vocab, generator)
    leaves = {leaf.name: _leaf(leaf.shape, leaf.dtype, leaf.vocab_size, generator) for leaf in inputs.leaves}
    return leaves if inputs.kind == "mapping" else tuple(leaves.values())


def model_paths(
    module: nn.Module, spec: ModelSpec, architecture: dict[str, Any], inputs: InputSpec | None, *, operation: str
) -> dict[str, Any]:
    """The public path report of ``module`` (``PathReport.to_public``), or ``{"error": message}``.

    Args:
        module: the built model (eval mode).
        spec: its input contract and output size.
        architecture: its stored architecture (``vocab_size`` bounds token ids; an exported program's ``outputs``
            name the tensors of a dict output, the first of which the report selects).
        inputs: the named inputs of a model taking several tensors, else None.
        operation: prefix of log messages.
    """
    outputs = architecture.get("outputs")
    output = next(iter(outputs)) if isinstance(outputs, dict) and outputs else None
    try:
        report = describe_paths(module, report_inputs(spec, architecture, inputs), output=output)
    except NtkServiceError as exc:  # the model's own refusal on these inputs: the report says so
        logger.info("%s: no path report (%s)", operation, exc)
        return {"error": str(exc)}
    except Exception as exc:  # an engine failure must not fail a registration: logged with its traceback
        logger.warning("%s: no path report", operation, exc_info=True)
        return {"error": f"the kernel engine could not describe this model: {type(exc).__name__}: {exc}"}
    return report.to_public()
