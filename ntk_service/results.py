"""Kernels at data-set scale, without a server: compute them tile by tile into a result on disk, and read them back.

- ``compute_ntk_tiled(model, x1, x2=None, *, out, mode, tile_size, resume=True, executor="local")``: the server's
  batch jobs as a library call (the same planner, executors, tile runner and result format), resumable after
  Ctrl-C or ``kill -9``, with a progress bar.
- ``open_result(path)``: a lazy, symmetry-aware view of a result (a job's or ``compute_ntk_tiled``'s); slicing reads
  only what the slice needs, and converts to numpy, dask or xarray.

The format (a Zarr v3 group ``result.zarr`` with the array ``theta``) is described in docs/results.md;
``xarray.open_zarr(path)`` and ``zarr.open_group(path)`` open it directly.

    >>> from ntk_service.results import compute_ntk_tiled, open_result
    >>> compute_ntk_tiled(model, x, out="kernel.zarr", mode="trace")   # doctest: +SKIP
    >>> theta = open_result("kernel.zarr")[:1000, :1000]               # doctest: +SKIP
    >>> np.asarray(theta).shape                                        # doctest: +SKIP
    (1000, 1000)
"""

from __future__ import annotations

from ntk_service.jobs.results import FORMAT_VERSION
from ntk_service.jobs.tiled import compute_ntk_tiled
from ntk_service.jobs.view import ResultView, open_result

__all__ = ["FORMAT_VERSION", "ResultView", "compute_ntk_tiled", "open_result"]
