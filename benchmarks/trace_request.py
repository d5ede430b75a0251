"""The walk of one kernel request (``POST /v1/models/{name}/ntk``) from the HTTP edge to the engine and back.

Runs the app in this process (``httpx.ASGITransport``, the lifespan run here, a tiny MLP registered first) and
traces one JSON request and one binary (safetensors, options in the query) request with ``sys.setprofile`` in
every thread (``threading.setprofile`` is set before the app starts, so the compute limiter's worker threads
inherit it). One warm request of each kind runs untraced first, so caches and lazy imports do not count.

What it counts, per request:

- **walk**: the sequence of ``ntk_service`` modules control is in, from the request's first package frame to its
  last: a call into a package function appends its module, a return appends the caller's module (when the caller
  is package code); consecutive repeats collapse. A coroutine suspending at an ``await`` and resuming is not a
  call or a return (it would add the middleware chain at every await). The engine is one stop: the first frame
  in ``kernels/`` is appended and everything beneath it is skipped until it returns. "route scope" is the part
  from the route handler's first entry to its last return (dependencies and middleware excluded); "request" is
  all of it.
  **module changes** = len(walk) - 1; **re-entries of server/kernel_inputs.py** = how many times the walk
  enters it; **request-path helper entries** = the same for kernel_inputs.py, reading.py and computing.py
  together (the first before issue 40, the other two after).
- **route steps**: how many times the walk leaves the route's module for another (the route's own calls out).
- **mode checks**: calls that parse or validate ``mode``: ``parse_any_mode`` / ``parse_mode`` /
  ``parse_kernel_mode``, a ``KernelMode`` / ``DerivedMode`` built from a value that is not already a member
  (outside those parsers), pydantic ``model_validate`` of data holding ``mode``, FastAPI's validation of a ``mode``
  query parameter.
- **output checks**: calls of ``check_output`` and ``parse_output`` (``output`` is not sent; both run anyway).
- **record reads**: calls of ``ModelRegistry.get``.
- **thread hops**: calls of ``anyio.to_thread.run_sync`` (starlette's ``run_in_threadpool`` goes through it).

With ``--stages`` it times instead where the milliseconds of a request go on a real server (a uvicorn
subprocess running this file with ``--serve-stages``: the route's steps wrapped with timestamps, the app wrapped by
an outermost ASGI timer) for issue 37's class (``TwoBranch`` d = 64, hidden 256, k = 4, registered with
``Client.register_module``, binary sides, a safetensors answer), each request paired with ``compute_ntk`` on the
same module in this process: median milliseconds of each stage, the engine's against the library's, and the
client's share (its wall less the server's time in the app).

    .venv/bin/python benchmarks/trace_request.py              # both requests, the numbers and the walks
    .venv/bin/python benchmarks/trace_request.py --json       # the numbers as JSON (for commit messages)
    .venv/bin/python benchmarks/trace_request.py --stages --mode trace --n 256 --requests 30
"""

from __future__ import annotations

import argparse
import asyncio
import dis
import enum
import inspect
import json
import sys
import tempfile
import threading
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

import ntk_service  # noqa: E402
from ntk_service import wire  # noqa: E402
from ntk_service.config import Settings  # noqa: E402
from ntk_service.kernels.modes import DerivedMode, KernelMode  # noqa: E402
from ntk_service.server.app import create_app  # noqa: E402

PACKAGE = str(Path(ntk_service.__file__).resolve().parent) + "/"
MODEL = {"family": "mlp", "input_dim": 4, "hidden": [8], "output_dim": 3, "activation": "tanh"}
MODE_CLASSES = (KernelMode, DerivedMode)
MODE_PARSERS = ("parse_any_mode", "parse_mode", "parse_kernel_mode")
OUTPUT_CHECKS = ("check_output", "parse_output")
ROUTE = "server/routes/kernels.py"
REQUEST_PATH = ("server/kernel_inputs.py", "server/reading.py", "server/computing.py")
"""The server's request-path helpers: kernel_inputs.py before issue 40, reading.py and computing.py after."""


def _module(code: types.CodeType) -> str | None:
    """The package-relative path of a code object's file, or None outside the package."""
    filename = code.co_filename
    return filename[len(PACKAGE) :] if filename.startswith(PACKAGE) else None


_RESUME, _YIELD_VALUE = dis.opmap["RESUME"], dis.opmap["YIELD_VALUE"]


def _is_await_step(frame: types.FrameType, event: str) -> bool:
    """A coroutine suspending at an await ('return' at YIELD_VALUE) or resuming after one ('call' at a RESUME
    whose argument is not 0): steps of the await chain, not calls or returns (CPython 3.11+ bytecode)."""
    if not frame.f_code.co_flags & (inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR):
        return False
    raw, at = frame.f_code.co_code, frame.f_lasti
    if event == "return":
        return raw[at] == _YIELD_VALUE
    return raw[at] == _RESUME and raw[at + 1] != 0


@dataclass
class Trace:
    """What one traced request did (see the module docstring)."""

    walk: list[str] = field(default_factory=list)
    route_start: int | None = None  # the walk's index where the route handler is first entered
    route_stop: int | None = None  # one past its index after the route handler's last return
    mode_checks: Counter[str] = field(default_factory=Counter)
    output_checks: Counter[str] = field(default_factory=Counter)
    record_reads: int = 0
    thread_hops: int = 0
    threads: set[int] = field(default_factory=set)


class Tracer:
    """A profile function for every thread; records into ``trace`` while it is set."""

    def __init__(self, route_code: types.CodeType) -> None:
        self.trace: Trace | None = None
        self.route_code = route_code
        self._lock = threading.Lock()
        self._local = threading.local()  # per thread: the engine frame being skipped

    def _append(self, module: str) -> None:
        assert self.trace is not None
        if not self.trace.walk or self.trace.walk[-1] != module:
            self.trace.walk.append(module)

    def __call__(self, frame: types.FrameType, event: str, arg: object) -> None:
        trace = self.trace
        if trace is None or event not in ("call", "return"):
            return
        code = frame.f_code
        if _is_await_step(frame, event):
            return
        with self._lock:
            if event == "call":
                self._count(trace, frame, code)
            engine = getattr(self._local, "engine", None)
            if engine is not None:  # inside the engine: skip until its entry frame returns
                if event == "return" and frame is engine:
                    self._local.engine = None
                    caller = frame.f_back
                    back = None if caller is None else _module(caller.f_code)
                    if back is not None:
                        self._append(back)
                return
            module = _module(code)
            if module is None:
                return
            trace.threads.add(threading.get_ident())
            if event == "call":
                self._append(module)
                if code is self.route_code and trace.route_start is None:
                    trace.route_start = len(trace.walk) - 1
                if module.startswith("kernels/"):
                    self._local.engine = frame
                return
            caller = frame.f_back
            back = None if caller is None else _module(caller.f_code)
            if back is not None:
                self._append(back)
            if code is self.route_code:
                trace.route_stop = len(trace.walk)

    def _count(self, trace: Trace, frame: types.FrameType, code: types.CodeType) -> None:
        name = code.co_name
        module = _module(code)
        if module is not None:
            if name in MODE_PARSERS:
                trace.mode_checks[f"{name} ({module})"] += 1
            elif name in OUTPUT_CHECKS:
                trace.output_checks[f"{name} ({module})"] += 1
            elif name == "get" and module == "registry/store.py":
                trace.record_reads += 1
            return
        filename = code.co_filename
        local = frame.f_locals
        if name == "run_sync" and filename.endswith("anyio/to_thread.py"):
            trace.thread_hops += 1
        elif name == "__call__" and filename.endswith("/enum.py") and local.get("cls") in MODE_CLASSES:
            caller = frame.f_back
            value = local.get("value")
            if caller is not None and caller.f_code.co_name not in MODE_PARSERS and not isinstance(value, enum.Enum):
                trace.mode_checks[f"{local['cls'].__name__}(...) in {caller.f_code.co_name}"] += 1
        elif name == "model_validate" and filename.endswith("pydantic/main.py"):
            data = local.get("obj")
            if isinstance(data, dict) and "mode" in data:
                trace.mode_checks[f"pydantic {local['cls'].__name__}"] += 1
        elif name == "validate" and filename.endswith("fastapi/_compat/v2.py"):
            model_field = local.get("self")
            if getattr(model_field, "name", None) == "mode":
                trace.mode_checks["fastapi query parameter"] += 1


def _route_code(app: Any) -> types.CodeType:
    for route in app.state.api_routes:  # the plain routes (FastAPI wraps included routers)
        if getattr(route, "path", None) == "/v1/models/{name}/ntk":
            return route.endpoint.__code__  # type: ignore[no-any-return]
    raise SystemExit("trace_request: no route /v1/models/{name}/ntk")


def _summary(trace: Trace) -> dict[str, Any]:
    def walk_stats(modules: list[str]) -> dict[str, Any]:
        collapsed = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]
        return {
            "module_changes": max(len(collapsed) - 1, 0),
            "modules": len(set(collapsed)),
            "kernel_inputs_entries": sum(1 for m in collapsed if m == "server/kernel_inputs.py"),
            "request_path_entries": sum(1 for m in collapsed if m in REQUEST_PATH),
            "route_steps": sum(1 for a, b in zip(collapsed, collapsed[1:], strict=False) if a == ROUTE and b != ROUTE),
            "entries": dict(Counter(collapsed).most_common()),
            "walk": collapsed,
        }

    whole = trace.walk
    route = whole[trace.route_start : trace.route_stop]
    return {
        "request": walk_stats(whole),
        "route scope": walk_stats(route),
        "mode_checks": sum(trace.mode_checks.values()),
        "mode_checks_by_site": dict(trace.mode_checks),
        "output_checks": sum(trace.output_checks.values()),
        "output_checks_by_site": dict(trace.output_checks),
        "record_reads": trace.record_reads,
        "thread_hops": trace.thread_hops,
        "threads": len(trace.threads),
    }


def _tensor_json(array: np.ndarray) -> dict[str, Any]:
    """The wire's JSON tensor with plain lists, as any JSON client sends it."""
    return {"shape": list(array.shape), "dtype": str(array.dtype), "data": array.reshape(-1).tolist()}


async def _requests(client: httpx.AsyncClient, x1: np.ndarray, x2: np.ndarray) -> dict[str, httpx.Request]:
    """The two requests, built (not sent)."""
    body = {"x1": _tensor_json(x1), "x2": _tensor_json(x2), "mode": "trace"}
    binary = wire.encode_safetensors({"x1": x1, "x2": x2})
    return {
        "json": client.build_request("POST", "/v1/models/m/ntk", json=body),
        "binary": client.build_request(
            "POST",
            "/v1/models/m/ntk",
            content=binary,
            params={"mode": "trace"},
            headers={"Content-Type": wire.MEDIA_SAFETENSORS, "Accept": wire.MEDIA_SAFETENSORS},
        ),
    }


async def _run(data_dir: Path) -> dict[str, Any]:
    app = create_app(Settings(data_dir=data_dir, side_cache_bytes=0))
    tracer = Tracer(_route_code(app))
    threading.setprofile(tracer)  # before the lifespan: the limiter's worker threads inherit it
    sys.setprofile(tracer)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://trace") as client:
                created = await client.post("/v1/models", json={"name": "m", "architecture": MODEL, "seed": 0})
                assert created.status_code == 201, created.text
                rng = np.random.default_rng(0)
                x1 = rng.standard_normal((3, 4)).astype(np.float32)
                x2 = rng.standard_normal((2, 4)).astype(np.float32)
                out: dict[str, Any] = {}
                for kind, request in (await _requests(client, x1, x2)).items():
                    warm = await client.send(request)  # untraced: caches and lazy imports
                    assert warm.status_code == 200, warm.text
                    request = (await _requests(client, x1, x2))[kind]
                    tracer.trace = Trace()
                    response = await client.send(request)
                    trace, tracer.trace = tracer.trace, None
                    assert response.status_code == 200, response.text
                    out[kind] = _summary(trace)
                return out
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


STAGE_STEPS = (
    ("app<", "read<", "middleware, routing, dependencies"),
    ("read<", "read>", "reading the body and its options"),
    ("sides<", "sides>", "a hop of its own for the record and sides (before: every request)"),
    ("hop<", "thread<", "to the compute worker thread"),
    ("prepare<", "prepare>", "the record read and the sides checked, in the compute hop"),
    ("kernel<", "kernel>", "the engine (compute_ntk)"),
    ("encode<", "encode>", "encoding the answer"),
    ("thread>", "hop>", "back to the event loop"),
    ("resp<", "resp>", "sending the answer (its last send returns)"),
    ("app<", "app>", "the app, in all"),
)
"""The stages ``--stages`` prints: (from mark, to mark, what happens between)."""


def serve_stages(out: Path) -> None:
    """Run the server (``Settings()`` from the environment) with each /ntk request's stage marks appended to
    ``out``, one line per request (``mark=ns`` pairs). Marks of steps this tree lacks are absent."""
    import functools
    import time

    from ntk_service.server import app as app_module
    from ntk_service.server import compute as compute_module
    from ntk_service.server.routes import kernels as route

    marks: dict[str, int] = {}
    sink = out.open("a", buffering=1)

    def timed(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):

            async def run_async(*args: Any, **kwargs: Any) -> Any:
                marks[name + "<"] = time.perf_counter_ns()
                result = await fn(*args, **kwargs)
                marks[name + ">"] = time.perf_counter_ns()
                return result

            return functools.wraps(fn)(run_async)

        def run(*args: Any, **kwargs: Any) -> Any:
            marks[name + "<"] = time.perf_counter_ns()
            result = fn(*args, **kwargs)
            marks[name + ">"] = time.perf_counter_ns()
            return result

        return functools.wraps(fn)(run)

    steps = {"read_kernel_request": "read", "load_kernel_sides": "sides", "prepare_kernel_sides": "prepare",
             "run_kernel": "kernel", "encode_theta": "encode"}  # fmt: skip
    for attribute, name in steps.items():
        if hasattr(route, attribute):  # a diagnostic of two trees: the base may lack a step
            setattr(route, attribute, timed(getattr(route, attribute), name))
    limited = compute_module.ComputeLimiter.run

    async def run_limited(self: Any, fn: Callable[[], Any], **kwargs: Any) -> Any:
        return await timed(limited, "hop")(self, timed(fn, "thread"), **kwargs)

    compute_module.ComputeLimiter.run = run_limited  # type: ignore[method-assign]
    create = app_module.create_app

    def create_app_timed(settings: Settings) -> Any:
        app = create(settings)

        async def outer(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http" or not scope["path"].endswith("/ntk"):
                return await app(scope, receive, send)
            marks.clear()
            marks["app<"] = time.perf_counter_ns()

            async def sending(message: Any) -> None:
                if message["type"] == "http.response.start":
                    marks["resp<"] = time.perf_counter_ns()
                await send(message)
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    marks["resp>"] = time.perf_counter_ns()

            await app(scope, receive, sending)
            marks["app>"] = time.perf_counter_ns()
            sink.write(" ".join(f"{key}={value}" for key, value in marks.items()) + "\n")
            return None

        return _Outermost(app, outer)

    app_module.create_app = create_app_timed  # type: ignore[assignment]
    app_module.serve(Settings())


class _Outermost:
    """The app with ``call`` in front: uvicorn calls the instance; everything else is the app's."""

    def __init__(self, app: Any, call: Callable[..., Any]) -> None:
        self._app, self._call = app, call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._app, name)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._call(scope, receive, send)


def stages(mode: str, n: int, requests: int) -> None:
    """Time the stages of ``requests`` /ntk requests on a real server (see the module docstring)."""
    import os
    import statistics
    import subprocess
    import time
    import warnings

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from ntk_service.client import Client
    from ntk_service.kernels import compute_ntk, retain_freed_memory
    from tests import conftest
    from tests.registry.exported_models import TwoBranch

    warnings.filterwarnings("ignore")  # torch.export's notices
    retain_freed_memory()  # as the server
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = TwoBranch(d=64, hidden=256, classes=4).eval()
    generator = torch.Generator().manual_seed(1)
    x1, x2 = torch.randn(n, 64, generator=generator), torch.randn(n, 64, generator=generator)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "stages.txt"
        port = conftest.free_port()
        env = {key: value for key, value in os.environ.items() if not key.startswith("NTK_")}
        env.update(NTK_HOST="127.0.0.1", NTK_PORT=str(port), NTK_DATA_DIR=str(Path(tmp) / "data"),
                   NTK_LOG_LEVEL="warning", NTK_API_KEYS=f"{conftest.READ_KEY}:read,{conftest.WRITE_KEY}:write",
                   NTK_MAX_BODY_BYTES=str(1024 * 2**20))  # fmt: skip
        log_path = Path(tmp) / "server.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, __file__, "--serve-stages", str(out)], cwd=ROOT, env=env, stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        launched = conftest.LiveServer(f"http://127.0.0.1:{port}", Path(tmp), process, log_path)
        server = conftest.wait_until_ready(launched)
        client = Client(server.url, api_key=server.write_key, timeout=600.0)
        try:
            client.register_module("two-branch", module, input_shape=(64,))
            for _ in range(3):  # warm: caches, lazy imports, the first hop's thread
                client.ntk_result("two-branch", x1.numpy(), x2.numpy(), mode=mode)
            out.write_text("")
            walls, library = [], []
            for _ in range(requests):
                start = time.perf_counter()
                compute_ntk(module, x1, x2, mode=mode)
                library.append(time.perf_counter() - start)
                start = time.perf_counter()
                client.ntk_result("two-branch", x1.numpy(), x2.numpy(), mode=mode)
                walls.append(time.perf_counter() - start)
            time.sleep(0.2)  # the server's last line
            rows = [dict((k, int(v)) for k, v in (kv.split("=") for kv in line.split())) for line in out.open()]
            # The last warm request's line can land after the truncation above (the server writes it once the
            # answer is sent): the timed requests are the last ones.
            rows = rows[-requests:]
        finally:
            client.close()
            server.stop()
    median = statistics.median
    print(f"{mode.upper()} N = M = {n}, {requests} requests, load average {os.getloadavg()[0]:.1f}: client wall "
          f"{1000 * median(walls):.2f} ms, library compute_ntk {1000 * median(library):.2f} ms, HTTP / library "
          f"{median(a / b for a, b in zip(walls, library, strict=True)):.3f} (paired)")  # fmt: skip
    print("| stage | ms: median (mean) | what |\n|---|---|---|")
    for start, stop, what in STAGE_STEPS:
        spans = [(row[stop] - row[start]) / 1e6 for row in rows if start in row and stop in row]
        if spans:
            print(f"| {start} -> {stop} | {median(spans):.3f} ({statistics.mean(spans):.3f}) | {what} |")
    gaps: dict[str, list[float]] = {}  # between consecutive marks: what the named stages leave out
    for row in rows:
        ordered = sorted(row.items(), key=lambda item: item[1])
        for (first, at), (then, later) in zip(ordered, ordered[1:], strict=False):
            gaps.setdefault(f"{first} -> {then}", []).append((later - at) / 1e6)
    for span, values in sorted(gaps.items(), key=lambda item: -statistics.median(item[1])):
        if statistics.median(values) >= 0.1 and span not in {f"{a} -> {b}" for a, b, _ in STAGE_STEPS}:
            print(f"| {span} | {median(values):.3f} ({statistics.mean(values):.3f}) | (between the stages above) |")
    engine = [(row["kernel>"] - row["kernel<"]) / 1e9 for row in rows]
    in_app = [(row["app>"] - row["app<"]) / 1e9 for row in rows]
    beside = [1000 * (a - e) for a, e in zip(in_app, engine, strict=True)]
    print(f"| app - engine | {median(beside):.3f} ({statistics.mean(beside):.3f}) | the server beside the engine |")
    print(
        f"| engine / library (paired) | {median(a / b for a, b in zip(engine, library, strict=True)):.3f} | "
        "the server's compute against the library's |"
    )
    print(
        f"| client wall - app | {1000 * median(w - a for w, a in zip(walls, in_app, strict=True)):.3f} | the "
        "client, the socket and uvicorn's parsing |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="Print the numbers as JSON.")
    parser.add_argument("--walk", action="store_true", help="Print each request's walk, module by module.")
    parser.add_argument("--stages", action="store_true", help="Time the stages of a request on a real server.")
    parser.add_argument("--mode", default="trace", choices=["full", "trace"], help="--stages. Default: trace.")
    parser.add_argument("--n", type=int, default=256, help="--stages: N = M. Default: 256.")
    parser.add_argument("--requests", type=int, default=30, help="--stages: timed requests. Default: 30.")
    parser.add_argument("--serve-stages", type=Path, help=argparse.SUPPRESS)  # the server --stages starts
    args = parser.parse_args()
    if args.serve_stages is not None:
        serve_stages(args.serve_stages)
        return
    if args.stages:
        stages(args.mode, args.n, args.requests)
        return
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(_run(Path(tmp)))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    rows: list[tuple[str, Callable[[dict[str, Any]], int]]] = [
        ("module changes (request)", lambda r: r["request"]["module_changes"]),
        ("distinct modules (request)", lambda r: r["request"]["modules"]),
        ("kernel_inputs.py entries (request)", lambda r: r["request"]["kernel_inputs_entries"]),
        ("module changes (route scope)", lambda r: r["route scope"]["module_changes"]),
        ("distinct modules (route scope)", lambda r: r["route scope"]["modules"]),
        ("kernel_inputs.py entries (route scope)", lambda r: r["route scope"]["kernel_inputs_entries"]),
        ("request-path helper entries (route scope)", lambda r: r["route scope"]["request_path_entries"]),
        ("route steps (calls out of the route module)", lambda r: r["route scope"]["route_steps"]),
        ("mode checks", lambda r: r["mode_checks"]),
        ("output checks", lambda r: r["output_checks"]),
        ("model record reads", lambda r: r["record_reads"]),
        ("thread hops", lambda r: r["thread_hops"]),
    ]
    print(f"{'':44s} {'json':>6s} {'binary':>6s}")
    for label, get in rows:
        print(f"{label:44s} {get(result['json']):>6} {get(result['binary']):>6}")
    for kind in ("json", "binary"):
        print(f"\n{kind}: mode checks {result[kind]['mode_checks_by_site']}")
        print(f"{kind}: output checks {result[kind]['output_checks_by_site']}")
        print(f"{kind}: entries per module (route scope) {result[kind]['route scope']['entries']}")
        if args.walk:
            print(f"{kind}: walk (route scope): " + " -> ".join(result[kind]["route scope"]["walk"]))


if __name__ == "__main__":
    main()
