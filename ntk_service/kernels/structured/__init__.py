"""Structured derivatives: the NTK from per-layer structure (see ``algorithm.py`` for the math and costs).

The package, in the order a block flows through it::

    options.py      StructuredOptions: every fast path as one switch, passed as data
    ops.py          the operators the engine reads, eager and ATen (a module's forward and a program's graph alike)
    rules.py        per op, how a parameter's Jacobian follows from the op's input a and output cotangent δ
    tracking.py     which tensors follow from a parameter (a scale, a transpose, a view) and how
    attention.py    F.multi_head_attention_forward as its ops, so its projections are rule uses
    coverage.py     the one analysis pass: which op calls the rules cover, how each parameter is contracted
    plan.py         the frozen plan it produces (StructurePlan, StructuredTerms), kept on the prepared problem
    recorder.py     the mode that collects a and the points to differentiate at during a capture
    chain.py        the closed-form capture of a pure Linear/activation pipeline
    capture.py      CAPTURES: the ordered table of capture strategies (applies / run)
    descriptors.py  typed descriptors of what a capture returns and a side holds (tensor, layout, shared)
    contraction.py  the per-mode contractions into one accumulator per block
    algorithm.py    Structured: the NtkAlgorithm tying them together

Example::

    >>> from ntk_service.kernels.structured import Structured, StructuredOptions
    >>> alg = Structured(options=StructuredOptions().without("chain"))  # one fast path off
"""

from __future__ import annotations

from ntk_service.kernels.structured.algorithm import (
    BATCHED_CAPTURE_WEIGHT,
    PER_EXAMPLE_CAPTURE_WEIGHT,
    Structured,
    structured_terms,
)
from ntk_service.kernels.structured.coverage import NOMINAL_PARTNERS
from ntk_service.kernels.structured.options import FAST_PATHS, StructuredOptions
from ntk_service.kernels.structured.plan import StructuredTerms

__all__ = [
    "BATCHED_CAPTURE_WEIGHT",
    "FAST_PATHS",
    "NOMINAL_PARTNERS",
    "PER_EXAMPLE_CAPTURE_WEIGHT",
    "Structured",
    "StructuredOptions",
    "StructuredTerms",
    "structured_terms",
]
