"""Forward-mode AD (``torch.func.jvp``) as the engine runs it: one thread at a time, and an operation of the model
without a forward-mode formula reported as the model's limit, not a server fault.

``forward_mode(operation, advice)`` is the ``with`` block every forward-mode pass runs in (the NTK-vector products,
the operators' J·u, the sketched features). torch.func.jvp's dual levels are process-global: two threads in jvp at
once fail with "no level exists" (measured with 4 threads on one model), so the block holds ``FORWARD_AD_LOCK``;
reverse-mode passes still run in parallel. Attention's fused kernels and an embedding's padding lookups need the
per-thread modes of ``math_attention`` and ``embedding_padding`` as well; the callers enter those where they apply.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ntk_service.errors import UnsupportedModel

__all__ = ["FORWARD_AD_LOCK", "forward_mode"]

FORWARD_AD_LOCK = threading.Lock()
"""Serializes forward-mode AD across the threads of the process (see the module docstring)."""


@contextmanager
def forward_mode(operation: str, advice: str) -> Iterator[None]:
    """The block of a forward-mode pass: under ``FORWARD_AD_LOCK``, torch's missing forward-mode formula translated.

    Args:
        operation (str): what the message starts with, e.g. "ntk_operator".
        advice (str): what to do instead, the message's end, e.g. "use implementation='jacobian_contraction'".

    Raises:
        UnsupportedModel: torch has no forward-mode AD for an operation the model uses (the old
            ``torch.nn.utils.weight_norm``'s kernel, some custom ops): "<operation>: the model uses an operation
            without forward-mode AD (<torch's first line>); <advice>".
    """
    with FORWARD_AD_LOCK:
        try:
            yield
        except NotImplementedError as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UnsupportedModel(
                f"{operation}: the model uses an operation without forward-mode AD ({reason}); {advice}"
            ) from exc
