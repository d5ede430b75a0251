"""Deprecated home of the pseudo-NTK's derived model, now ``ntk_service.kernels.derived`` (the derived modes, an
engine primitive below ``api.py``); each name read here warns ``DeprecationWarning`` (kept for one release)."""

from __future__ import annotations

from ntk_service.kernels._moved import moved

__getattr__ = moved(
    __name__, "ntk_service.kernels.derived", ("SUMMED_OUTPUTS_PREFIX", "SummedOutputs", "pseudo_key", "pseudo_params")
)
