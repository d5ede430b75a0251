"""ntk-service: empirical neural tangent kernels of PyTorch models, as a library and an HTTP service.

The top-level package stays light: importing it loads neither torch, fastapi nor httpx. ``Client`` and
``KernelResult`` are loaded on first access (PEP 562), so ``import ntk_service`` stays cheap for the CLI's
``--help`` and for the server, which never needs the client.

Example::

    >>> import ntk_service
    >>> with ntk_service.Client("http://127.0.0.1:8000") as client:  # doctest: +SKIP
    ...     theta = client.ntk("mlp", x1)  # (N, N, k, k)

Where things live: the engine in ``ntk_service.kernels`` (``compute_ntk``), the exception tree in
``ntk_service.errors``, the wire codecs in ``ntk_service.wire``, the server in ``ntk_service.server``.

Importing it before torch sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment says otherwise (NOTE [OpenMP wait
policy] in ``ntk_service._openmp``): on a machine shared with other torch processes that keeps kernels from running
10x slower.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

from ntk_service._openmp import apply_wait_policy as _apply_wait_policy

_apply_wait_policy()  # before anything below can import torch

from ntk_service.errors import NtkServiceError  # noqa: E402

if _typing.TYPE_CHECKING:
    from ntk_service.client import Client, KernelResult

__version__ = "0.1.0"

__all__ = ["Client", "KernelResult", "NtkServiceError", "__version__"]

_LAZY = {"Client": "ntk_service.client", "KernelResult": "ntk_service.client"}


def __getattr__(name: str) -> _typing.Any:
    if name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ntk_service' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
