"""Deprecated home of the pseudo-NTK's derived model: ``ntk_service.kernels.derived`` (the derived modes, an engine
primitive below ``api.py``).

Kept for one release; importing it warns ``DeprecationWarning``.
"""

from __future__ import annotations

import warnings

from ntk_service.kernels.derived import SUMMED_OUTPUTS_PREFIX, SummedOutputs, pseudo_key, pseudo_params

__all__ = ["SUMMED_OUTPUTS_PREFIX", "SummedOutputs", "pseudo_key", "pseudo_params"]

warnings.warn(
    "ntk_service.kernels.family.pseudo is deprecated and will be removed in the next release; import from "
    "ntk_service.kernels.derived",
    DeprecationWarning,
    stacklevel=2,
)
