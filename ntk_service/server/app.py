"""The app factory and its lifespan: ``create_app(settings)`` builds a FastAPI app, ``serve(settings)`` runs
it.

Objects with a lifetime (the model registry, the data-set store, the side cache, the compute limiter) are
built in the lifespan, stored on ``app.state`` and reached through ``deps``; ``/readyz`` answers 503 until
they exist. Nothing is built at import time, so two apps in one process (tests) share nothing.

    >>> app = create_app(Settings(data_dir=tmp_path))  # doctest: +SKIP
    >>> serve(Settings(host="0.0.0.0", api_keys="secret:write"))  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import astuple
from typing import Any

import anyio.lowlevel
import anyio.to_thread
import torch
import uvicorn
from fastapi import FastAPI

from ntk_service import __version__
from ntk_service.config import LOOPBACK_HOSTS, Settings
from ntk_service.errors import UnknownDevice
from ntk_service.jobs import JobManager, JobStore
from ntk_service.jobs.executors import executor_for
from ntk_service.jobs.store import JOBS_DB
from ntk_service.kernels import SideCache, parse_device, reuse_large_buffers, warm_up
from ntk_service.registry import DatasetStore, ModelRegistry
from ntk_service.server.auth import KeyRing
from ntk_service.server.banner import startup_lines
from ntk_service.server.compute import ComputeLimiter, configure_torch_threads
from ntk_service.server.docs import install_docs
from ntk_service.server.error_responses import install_error_handlers
from ntk_service.server.media import BodyLimitMiddleware
from ntk_service.server.metrics import Metrics, MetricsMiddleware
from ntk_service.server.openapi import install_openapi, operation_id
from ntk_service.server.routes import (
    analysis,
    architectures,
    attribution_features,
    attribution_jobs,
    console,
    datasets,
    feature_jobs,
    health,
    job_analysis,
    jobs,
    kernel_family,
    kernels,
    models,
    solve,
    solve_jobs,
)
from ntk_service.server.shutdown import Drain, DrainMiddleware, GracefulServer

__all__ = ["check_bind_address", "check_device", "create_app", "serve"]

logger = logging.getLogger(__name__)

API_DESCRIPTION = """\
Empirical neural tangent kernels Θ(x1, x2) = J(x1) J(x2)ᵀ of registered PyTorch models.

Send `Authorization: Bearer <key>`; `read` keys list and compute, `write` keys also register, upload and
delete. Tensors travel as JSON `{"shape", "dtype", "data"}` or as `application/x-npy` /
`application/x-safetensors` bodies; responses follow `Accept`. Errors are `{"error": {"type", "message"}}`.
"""


def check_bind_address(settings: Settings) -> None:
    """Refuse to serve an open server (no API keys) on anything but loopback.

    Raises:
        ValueError: ``settings.host`` is not loopback and no key is configured; the message says how to fix
        it.
    """
    if settings.is_open and settings.host not in LOOPBACK_HOSTS:
        raise ValueError(
            f"serve: refusing to bind {settings.host!r} without API keys (anyone on the network "
            "could register "
            "models and use the CPU); set NTK_API_KEYS='<key>:write,<key>:read' or NTK_API_KEY_FILE, "
            "or bind 127.0.0.1"
        )


def check_device(settings: Settings) -> torch.device:
    """The device kernels run on (``NTK_DEVICE``), checked to exist on this machine.

    Raises:
        ValueError: CUDA asked for where it is absent, or a CUDA index past the visible GPUs; the message says
        what this machine has and how to fix it.
    """
    try:
        return parse_device(settings.device, operation="serve: NTK_DEVICE")
    except UnknownDevice as exc:
        raise ValueError(exc.message) from None


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    app.state.drain.bind()
    configure_torch_threads(settings.torch_threads())
    if settings.reuse_large_buffers and app.state.device.type == "cpu":
        # before any worker thread allocates: every thread then shares the heap that keeps them (NOTE [large buffers])
        reuse_large_buffers()

    def open_stores() -> tuple[ModelRegistry, DatasetStore]:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        registry = ModelRegistry(
            settings.data_dir, allowed_factories=settings.allowed_factories, device=app.state.device
        )
        return registry, DatasetStore(settings.data_dir)

    registry, datasets = await anyio.to_thread.run_sync(open_stores)
    # the engine's one-time imports (and the device's libraries), paid before /readyz says ready
    await anyio.to_thread.run_sync(warm_up, app.state.device)
    app.state.registry = registry
    app.state.datasets = datasets
    app.state.side_cache = SideCache(max_bytes=settings.side_cache_bytes)
    app.state.metrics.watch_side_cache(app.state.side_cache)
    app.state.limiter = ComputeLimiter(
        concurrency=settings.compute_concurrency, max_queue=settings.max_queue, metrics=app.state.metrics
    )
    # after the registry, data sets and limiter: resumes unfinished jobs of every kind
    manager = await anyio.to_thread.run_sync(
        _open_jobs, settings, registry, datasets, app.state.limiter, anyio.lowlevel.current_token()
    )
    app.state.jobs = manager
    app.state.metrics.watch_jobs(manager)
    app.state.metrics.watch_job_disk(lambda: astuple(manager.disk_usage()))
    if app.state.keyring.is_open:
        logger.warning(
            "no API keys configured (NTK_API_KEYS / NTK_API_KEY_FILE): every request is allowed; "
            "the server is reachable from this machine only"
        )
    logger.info(
        "ntk-service ready: data in %s, %d compute slot(s) on %s\n%s",
        settings.data_dir,
        settings.compute_concurrency,
        app.state.device,
        startup_lines(settings.host, settings.port, hostname=socket.gethostname()),
    )
    app.state.ready = True
    try:
        yield
    finally:
        app.state.ready = False
        app.state.jobs = None  # job routes answer 503 from here
        # running units finish off the event loop (which they still need for their compute slots) and are recorded;
        # the rest resume at the next start
        await anyio.to_thread.run_sync(manager.stop)
        registry.close()
        datasets.close()


def _open_jobs(
    settings: Settings, registry: ModelRegistry, datasets: DatasetStore, limiter: ComputeLimiter, token: Any
) -> JobManager:
    """The job store, executor and manager of the service, started (unfinished jobs resume): every unit of every
    job runs under ``limiter`` (the local executor's panels, a solve's products, a features job's chunks)."""
    run_compute = limiter.blocking(token, operation="job")
    manager = JobManager(
        data_dir=settings.data_dir,
        store=JobStore(settings.data_dir / "jobs" / JOBS_DB),
        models=registry,
        datasets=datasets,
        executor=executor_for(settings, run_compute=run_compute),
        run_compute=run_compute,
        default_tile_size=settings.job_tile_size,
        disk_budget_bytes=settings.job_disk_budget_bytes,
        memory_budget_bytes=settings.memory_budget_bytes,
        results_dir=settings.job_results_dir,
        panel_seconds=settings.job_panel_seconds,
    )
    manager.start()
    return manager


def create_app(settings: Settings) -> FastAPI:
    """Build the FastAPI app for ``settings`` (registry and stores open in its lifespan).

    Args:
        settings: the whole configuration; nothing is read from the environment here.

    Returns:
        The app, ready for uvicorn (or ``httpx.ASGITransport`` with the lifespan run by the caller).

    Raises:
        ValueError: an open server on a non-loopback host (see ``check_bind_address``), or a device this machine
        does not have (``check_device``).
    """
    check_bind_address(settings)
    device = check_device(settings)
    app = FastAPI(
        title="ntk-service",
        description=API_DESCRIPTION,
        version=__version__,
        lifespan=_lifespan,
        generate_unique_id_function=operation_id,
        docs_url=None,  # served from packaged assets by install_docs, not from a CDN
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.device = device
    app.state.keyring = KeyRing(settings.api_key_scopes())
    app.state.metrics = Metrics(build={"version": __version__, "torch": torch.__version__})
    app.state.ready = False
    app.state.drain = Drain()
    install_error_handlers(app)
    install_openapi(app)
    install_docs(app)
    # add_middleware puts the newest outermost: metrics see every response, 413s included.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    app.add_middleware(DrainMiddleware, drain=app.state.drain)  # outermost: ends streams at shutdown
    routers = [
        module.router
        for module in (health, architectures, models, datasets, kernels, kernel_family, jobs, analysis, job_analysis)
    ]
    routers += [solve.router, solve_jobs.router, feature_jobs.router]  # matrix-free solves and features (jobs/kinds)
    routers += [attribution_features.router, attribution_jobs.router]  # data attribution (jobs/kinds/attribution*)
    routers.append(console.router)  # GET / (the lab console, with its Content-Security-Policy) and /v1/whoami
    for router in routers:
        app.include_router(router)
    # FastAPI wraps included routers lazily; keep the plain routes for the 405 handler's Allow header.
    app.state.api_routes = [route for router in routers for route in router.routes]
    return app


def serve(settings: Settings) -> None:
    """Run the service with uvicorn on ``settings.host:settings.port`` until SIGTERM or Ctrl-C, then shut down
    gracefully (``server/shutdown.py``: in-flight requests finish within ``settings.shutdown_timeout_s``, streams
    end, running job tiles finish and the rest resume at the next start).

    Raises:
        ValueError: an open server on a non-loopback host (see ``check_bind_address``).
    """
    check_bind_address(settings)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=settings.shutdown_timeout_s,
    )
    GracefulServer(config, drain=app.state.drain).run()
