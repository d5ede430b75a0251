"""Issue 37: an exported program's kernel against the same module's, NTK parameterization against nn.Linear, and a
researcher's own class over HTTP against the library call — each part alternating its contenders in one process.

Parts (``--parts``, default all three):

- ``programs``: per model and mode, at N = M = ``--n`` (x2 given): the module's ``structured`` kernel, the exported
  program's ``auto`` and ``structured`` kernels (the program exported as ``Client.register_module`` does and loaded
  by the service's checked loader, as the server holds it) and the torch.func tutorial's contraction on the module
  (``torchfunc_tutorial.tutorial_ntk``), one call each per round. Targets: exported auto / module structured <=
  1.15, and the tutorial / exported auto > 1.
- ``ntk``: ``NtkLinear`` against ``nn.Linear`` of the same shapes (AUTO both, and the NtkLinear program): the
  64-1024-1024-1 MLP at N = 128 TRACE of the issue and the benchmark MLP 784-512-512-10 at N = 64 FULL and TRACE.
- ``http``: a two-branch class with LayerNorm (``TwoBranch``, k = 4) registered with ``Client.register_module`` on a
  real server (a uvicorn subprocess), its kernel at N = M = ``--n-http`` requested with ``Client.ntk`` (x1 and x2
  sent, theta received: end to end from the client) against ``compute_ntk`` on the same module in this process.
  Target: HTTP / library <= 1.2. Beside them, the stack's floor: the same bytes each way (x1 and x2 in, theta out)
  through the same httpx client and uvicorn, to a bare ASGI app that does nothing else (``_bare_asgi.py``); (library
  + its round trip) / library is the best HTTP / library this stack allows. With ``--base TREE`` a second server
  runs TREE's ntk_service (e.g. ``git archive HEAD~1 | tar -x -C /tmp/base``) and its requests alternate with this
  tree's: the A/B of a change to the HTTP path.

Each row prints the median wall seconds and CPU seconds (user + system of this process; the server's own for the
HTTP rows is not in them) and the median of the per-round ratios (each round's calls ran back to back), with the
load average beside. The HTTP part also pairs the compute the server measured (``elapsed_ms``) with the library
call of the same round: the server's compute against the library's, apart from the transport. Every kernel is
checked to agree with the module's (1e-4 of max|theta|, float32).

    .venv/bin/python benchmarks/bench_exported_kernels.py                                  # all parts, idle run
    .venv/bin/python benchmarks/bench_exported_kernels.py --parts programs --models mlp gated_loop --rounds 3
    .venv/bin/python benchmarks/bench_exported_kernels.py --small --rounds 1                # smoke run, small sizes
    .venv/bin/python benchmarks/bench_exported_kernels.py --parts http --rounds 30 --base /tmp/base  # HTTP A/B
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE [OpenMP wait policy] in bench_structured.py

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT.parent), str(ROOT)]

import torch  # noqa: E402
from _models import ResNet, TransformerClassifier, make_cnn, make_mlp, randomize_batchnorm  # noqa: E402
from torch import nn  # noqa: E402
from torchfunc_tutorial import tutorial_ntk  # noqa: E402

from ntk_service import wire  # noqa: E402
from ntk_service.client._export import export_module  # noqa: E402
from ntk_service.kernels import compute_ntk, retain_freed_memory  # noqa: E402
from ntk_service.layers import NtkLinear  # noqa: E402
from ntk_service.registry.exported import load_exported  # noqa: E402
from tests.registry.exported_models import GatedLoop, TwoBranch  # noqa: E402


@dataclass(frozen=True)
class Bench:
    """A benchmark model: its module, inputs (n, seed) -> x, export spec, and the kernel's output selection."""

    build: Callable[[], nn.Module]
    inputs: Callable[[int, int], Any]
    shape: Any
    dtype: Any
    output: str | None = None
    select: Callable[[Any], torch.Tensor] | None = None


def _floats(*shape: int) -> Callable[[int, int], torch.Tensor]:
    return lambda n, seed: torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed))


def _ids(vocab: int, length: int, name: str | None = None) -> Callable[[int, int], Any]:
    def make(n: int, seed: int) -> Any:
        ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))
        return ids if name is None else {name: ids}

    return make


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return build().eval()

    return make


def _resnet() -> nn.Module:
    return randomize_batchnorm(ResNet(), torch.Generator().manual_seed(100))


def _hf(kind: str) -> nn.Module:
    import transformers

    if kind == "bert":
        config = transformers.BertConfig(
            vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=32,
        )  # fmt: skip
        return transformers.BertForMaskedLM(config)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=4)
        )
    config = transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, num_labels=10,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config)


def _logits(index: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Any], torch.Tensor]:
    return lambda out: index(out["logits"] if isinstance(out, dict) else out.logits)


def _models(small: bool) -> dict[str, Bench]:
    width = 16 if small else 256
    return {
        "mlp": Bench(_seeded(make_mlp), _floats(784), (784,), "float32"),
        "cnn": Bench(_seeded(make_cnn), _floats(3, 32, 32), (3, 32, 32), "float32"),
        "resnet": Bench(_seeded(_resnet), _floats(3, 32, 32), (3, 32, 32), "float32"),
        "transformer": Bench(_seeded(TransformerClassifier), _ids(256, 32), (32,), "int64"),
        "gated_loop": Bench(_seeded(lambda: GatedLoop(width=width, depth=3, classes=10)), _floats(width), (width,),
                            "float32"),
        "two_branch": Bench(_seeded(lambda: TwoBranch(d=64, hidden=width, classes=4)), _floats(64), (64,), "float32"),
        "bert": Bench(_seeded(lambda: _hf("bert")), _ids(100, 16, "input_ids"), {"input_ids": (16,)},
                      {"input_ids": "int64"}, "logits[:, 2, :8]", _logits(lambda t: t[:, 2, :8])),
        "gpt2": Bench(_seeded(lambda: _hf("gpt2")), _ids(100, 16, "input_ids"), {"input_ids": (16,)},
                      {"input_ids": "int64"}, "logits[:, -1, :8]", _logits(lambda t: t[:, -1, :8])),
        "vit": Bench(_seeded(lambda: _hf("vit")), lambda n, s: {"pixel_values": _floats(3, 16, 16)(n, s)},
                     {"pixel_values": (3, 16, 16)}, {}, "logits", _logits(lambda t: t)),
    }  # fmt: skip


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _alternate(
    contenders: dict[str, Callable[[], Any]], rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, Any]]:
    """One warm-up call each, then ``rounds`` rounds of one call each in turn, every other round in reverse order
    (a contender's place in the round, e.g. after the heavy one, is no advantage): wall s, CPU s, last results."""
    results = {name: call() for name, call in contenders.items()}
    wall: dict[str, list[float]] = {name: [] for name in contenders}
    cpu: dict[str, list[float]] = {name: [] for name in contenders}
    for index in range(rounds):
        for name, call in list(contenders.items())[:: -1 if index % 2 else 1]:
            c, t = _cpu(), time.perf_counter()
            results[name] = call()
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(_cpu() - c)
    return wall, cpu, results


def _paired(times: dict[str, list[float]], num: str, den: str) -> float:
    return statistics.median(a / b for a, b in zip(times[num], times[den], strict=True))


def _theta(result: Any) -> torch.Tensor:
    return torch.as_tensor(result.theta if hasattr(result, "theta") else result)


def _check(results: dict[str, Any], reference: str, label: str) -> None:
    expected = _theta(results[reference]).double()
    scale = float(expected.abs().max())
    for name, result in results.items():
        error = float((_theta(result).double() - expected).abs().max()) / scale
        assert error < 1e-4, f"{label}: {name} differs from {reference} by {error:.1e} of max|theta|"


def _row(label: str, name: str, wall: dict[str, list[float]], cpu: dict[str, list[float]], chose: str = "") -> None:
    print(f"| {label} | {name} | {chose} | {statistics.median(wall[name]):.4f} | {statistics.median(cpu[name]):.4f} |")


def _program_case(
    label: str, module: nn.Module, graph: nn.Module, x1: Any, x2: Any, mode: str, bench: Bench, rounds: int
) -> tuple[str, float, float, float, float]:
    def kernel(model: nn.Module, implementation: str) -> Any:
        return compute_ntk(model, x1, x2, mode=mode, implementation=implementation, output=bench.output)

    contenders: dict[str, Callable[[], Any]] = {
        "module structured": lambda: kernel(module, "structured"),
        "exported auto": lambda: kernel(graph, "auto"),
        "exported structured": lambda: kernel(graph, "structured"),
        "tutorial": lambda: tutorial_ntk(module, x1, x2, mode, bench.select),
    }
    wall, cpu, results = _alternate(contenders, rounds)
    _check(results, "module structured", label)
    for contender in contenders:
        chose = results[contender].implementation.value if contender != "tutorial" else ""
        _row(label, contender, wall, cpu, chose)
    return (
        label,
        _paired(wall, "exported auto", "module structured"),
        _paired(cpu, "exported auto", "module structured"),
        _paired(wall, "tutorial", "exported auto"),
        _paired(cpu, "tutorial", "exported auto"),
    )


def programs_part(names: list[str], n: int, modes: list[str], rounds: int, small: bool) -> None:
    print(f"\n## programs: N = M = {n}, median of {rounds} alternating rounds, torch {torch.get_num_threads()} threads")
    print("| case | contender | auto ran | wall s | CPU s |\n|---|---|---|---|---|")
    summary = []
    for name in names:
        bench = _models(small)[name]
        module = bench.build()
        program = load_exported(export_module(module, input_shape=bench.shape, input_dtype=bench.dtype), operation="b")
        x1, x2 = bench.inputs(n, 1), bench.inputs(n, 2)
        for mode in modes:
            summary.append(_program_case(f"{name} {mode.upper()}", module, program.module, x1, x2, mode, bench, rounds))
    print(f"\nload average {os.getloadavg()[0]:.1f}; targets: exported auto / module structured <= 1.15, tutorial / "
          "exported auto > 1 (paired medians)")  # fmt: skip
    print("| case | exported auto / module structured (wall, CPU) | tutorial / exported auto (wall, CPU) |")
    print("|---|---|---|")
    for label, a, b, c, d in summary:
        print(f"| {label} | {a:.2f}, {b:.2f} | {c:.2f}, {d:.2f} |")


def _ntk_case(dims: tuple[int, ...], n: int, mode: str, rounds: int) -> tuple[str, float, float]:
    def mlp(layer: Callable[[int, int], nn.Module]) -> nn.Module:
        layers: list[nn.Module] = []
        for a, b in zip(dims, dims[1:], strict=False):
            layers += [layer(a, b), nn.ReLU()]
        return _seeded(lambda: nn.Sequential(*layers[:-1]))()

    linear, ntk = mlp(nn.Linear), mlp(NtkLinear)
    program = load_exported(export_module(ntk, input_shape=(dims[0],), input_dtype="float32"), operation="b")
    x1, x2 = _floats(dims[0])(n, 1), _floats(dims[0])(n, 2)
    contenders: dict[str, Callable[[], Any]] = {
        "nn.Linear": lambda: compute_ntk(linear, x1, x2, mode=mode),
        "NtkLinear": lambda: compute_ntk(ntk, x1, x2, mode=mode),
        "NtkLinear exported": lambda: compute_ntk(program.module, x1, x2, mode=mode),
    }
    wall, cpu, results = _alternate(contenders, rounds)
    _check({k: v for k, v in results.items() if k != "nn.Linear"}, "NtkLinear", "ntk")
    label = f"MLP {'-'.join(map(str, dims))} N={n} {mode.upper()}"
    for contender in contenders:
        _row(label, contender, wall, cpu, results[contender].implementation.value)
    return label, _paired(wall, "NtkLinear", "nn.Linear"), _paired(cpu, "NtkLinear", "nn.Linear")


def ntk_part(rounds: int, small: bool) -> None:
    print(f"\n## ntk: NtkLinear vs nn.Linear of the same shapes (auto), median of {rounds} alternating rounds")
    print("| case | contender | auto ran | wall s | CPU s |\n|---|---|---|---|---|")
    cases = [((64, 1024, 1024, 1), 128, "trace"), ((784, 512, 512, 10), 64, "full"), ((784, 512, 512, 10), 64, "trace")]
    if small:
        cases = [((16, 64, 64, 1), 32, "trace"), ((16, 32, 32, 4), 16, "full")]
    summary = [_ntk_case(dims, n, mode, rounds) for dims, n, mode in cases]
    print(f"\nload average {os.getloadavg()[0]:.1f}")
    print("| case | NtkLinear / nn.Linear (wall, CPU) |\n|---|---|")
    for label, a, b in summary:
        print(f"| {label} | {a:.2f}, {b:.2f} |")


def _server_from(tree: Path, data_dir: Path) -> Any:
    """A live server (``tests.conftest.LiveServer``) running ``tree``'s ntk_service: the base of an A/B."""
    import subprocess

    from tests import conftest

    port = conftest.free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("NTK_")}
    env.update(NTK_HOST="127.0.0.1", NTK_PORT=str(port), NTK_DATA_DIR=str(data_dir), NTK_LOG_LEVEL="warning",
               NTK_API_KEYS=f"{conftest.READ_KEY}:read,{conftest.WRITE_KEY}:write",
               NTK_MAX_BODY_BYTES=str(1024 * 2**20), NTK_MAX_JSON_RESPONSE_BYTES=str(1024 * 2**20),
               PYTHONPATH=str(tree))  # fmt: skip
    data_dir.mkdir(parents=True)
    log_path = data_dir.parent / "base-server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", conftest._SERVE], cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    return conftest.wait_until_ready(conftest.LiveServer(f"http://127.0.0.1:{port}", data_dir, process, log_path))


@dataclass
class _BareServer:
    """``_bare_asgi.py`` on uvicorn in a subprocess, and an httpx client for it (what ``Client`` uses)."""

    process: Any
    client: Any

    def post(self, body: bytes, answer_bytes: int) -> bytes:
        """Send ``body`` as a kernel request's sides travel; receive ``answer_bytes`` as theta would."""
        headers = {"content-type": wire.MEDIA_SAFETENSORS}
        return bytes(self.client.post("/", params={"bytes": answer_bytes}, content=body, headers=headers).content)

    def stop(self) -> None:
        self.client.close()
        self.process.terminate()
        self.process.wait(timeout=20)


def _bare_server() -> _BareServer:
    import subprocess

    import httpx

    from tests import conftest

    port = conftest.free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "_bare_asgi:app", "--app-dir", str(ROOT), "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"]
    )  # fmt: skip
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60.0)
    deadline = time.monotonic() + 60
    while True:
        try:
            client.post("/", params={"bytes": 1}, content=b"")
            return _BareServer(process, client)
        except httpx.TransportError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise
            time.sleep(0.2)


def results_bytes(module: nn.Module, x1: torch.Tensor, x2: torch.Tensor, mode: str) -> int:
    """theta's float32 bytes: (N, M, k, k) FULL, (N, M) TRACE."""
    k = int(module(x1[:1]).shape[-1])
    entries = x1.shape[0] * x2.shape[0] * (k * k if mode == "full" else 1)
    return 4 * entries


def http_part(n: int, modes: list[str], rounds: int, small: bool, base: Path | None = None) -> None:
    from ntk_service.client import Client
    from tests.conftest import start_live_server

    hidden = 32 if small else 256
    module = _seeded(lambda: TwoBranch(d=64, hidden=hidden, classes=4))()
    x1, x2 = _floats(64)(n, 1), _floats(64)(n, 2)
    print(f"\n## http: TwoBranch(d=64, hidden={hidden}, k=4) registered with Client.register_module, N = M = {n}")
    with tempfile.TemporaryDirectory() as tmp:
        this = "HTTP Client.ntk_result"
        servers = {this: start_live_server(
            Path(tmp) / "data", max_body_bytes=str(1024 * 2**20), max_json_response_bytes=str(1024 * 2**20)
        )}  # fmt: skip
        if base is not None:
            servers["HTTP (base tree)"] = _server_from(base, Path(tmp) / "base-data")
        clients = {}
        bare = _bare_server()
        try:
            for label, server in servers.items():
                clients[label] = Client(server.url, api_key=server.write_key, timeout=600.0)
                info = clients[label].register_module("two-branch", module, input_shape=(64,))
            paths: dict[str, Any] = dict(info["parameter_paths"] or {})
            groups = [(g["group"], g["form"]) for g in paths.get("groups", [])]
            print(f"registered: class {info['class_name']}; auto {paths.get('auto')}; paths {groups}")
            print("| case | contender | auto ran | wall s | CPU s (this process) |\n|---|---|---|---|---|")
            summary = []
            for mode in modes:
                contenders: dict[str, Callable[[], Any]] = {
                    "library compute_ntk": lambda mode=mode: compute_ntk(module, x1, x2, mode=mode),
                }
                served: dict[str, list[float]] = {label: [] for label in clients}  # the server's compute, per call

                def request(label: str, mode: str = mode, served: dict[str, list[float]] = served) -> Any:
                    result = clients[label].ntk_result("two-branch", x1.numpy(), x2.numpy(), mode=mode)
                    served[label].append(result.elapsed_ms / 1000)
                    return result

                for label in clients:
                    contenders[label] = lambda label=label: request(label)
                # the stack's floor: the same bytes each way through httpx and uvicorn, nothing else
                body = wire.encode_safetensors({"x1": x1.numpy(), "x2": x2.numpy()})
                theta_bytes = results_bytes(module, x1, x2, mode)
                contenders["bare uvicorn + httpx, same bytes"] = lambda b=body, size=theta_bytes: bare.post(b, size)
                # the fixed cost of a request: one example each side, where the compute is the engine's own overhead
                contenders["library N=1"] = lambda mode=mode: compute_ntk(module, x1[:1], x2[:1], mode=mode)
                contenders["HTTP N=1"] = lambda mode=mode: clients["HTTP Client.ntk_result"].ntk_result(
                    "two-branch", x1[:1].numpy(), x2[:1].numpy(), mode=mode
                )
                wall, cpu, results = _alternate(contenders, rounds)
                fixed = {name: results.pop(name) for name in ("library N=1", "HTTP N=1")}
                answered = len(results.pop("bare uvicorn + httpx, same bytes"))
                assert answered == theta_bytes, f"the bare server answered {answered} bytes, not {theta_bytes}"
                _check(results, "library compute_ntk", "http")
                _check(fixed, "library N=1", "http N=1")
                results.update(fixed)
                label = f"TwoBranch N={n} {mode.upper()}"
                for name in clients:  # the warm-up call's first: dropped, as in wall
                    served[name] = served[name][1:]
                    print(f"| {label} | (compute measured by the server of {name}) | | "
                          f"{statistics.median(served[name]):.4f} | |")  # fmt: skip
                for contender in contenders:
                    chose = getattr(results.get(contender), "implementation", "")
                    _row(label, contender, wall, cpu, str(getattr(chose, "value", chose)))
                ratios = [f"{name} / library {_paired(wall, name, 'library compute_ntk'):.2f}" for name in clients]
                library = wall["library compute_ntk"]
                overhead = {}  # what HTTP adds to the server's compute: the A/B of the path, the compute's noise apart
                for name in clients:
                    overhead[name] = statistics.median(w - c for w, c in zip(wall[name], served[name], strict=True))
                    print(f"| {label} | (wall less the server's compute: {name}) | | {overhead[name]:.4f} | |")
                ratios += [f"its server's compute / library {_paired({'s': served[n], 'l': library}, 's', 'l'):.2f}"
                           for n in clients]  # fmt: skip
                floor = wall["bare uvicorn + httpx, same bytes"]
                floor_ms = 1000 * statistics.median(floor)
                best = statistics.median((lib + bare_s) / lib for lib, bare_s in zip(library, floor, strict=True))
                ratios.append(f"the stack's floor: bare round trip {floor_ms:.2f} ms, (library + it) / library "
                              f"{best:.2f}")  # fmt: skip
                fixed_ms = statistics.median(a - b for a, b in zip(wall["HTTP N=1"], wall["library N=1"], strict=True))
                ratios.append(f"fixed cost of a request (HTTP - library at N=1) {1000 * fixed_ms:.1f} ms")
                if base is not None:
                    ratios.append(f"this tree / base {_paired(wall, 'HTTP Client.ntk_result', 'HTTP (base tree)'):.2f}")
                    ratios.append(f"wall less the server's compute: this tree {1000 * overhead[this]:.2f} ms, base "
                                  f"{1000 * overhead['HTTP (base tree)']:.2f} ms")  # fmt: skip
                summary.append((label, ", ".join(ratios)))
        finally:
            bare.stop()
            for client in clients.values():
                client.close()
            for server in servers.values():
                server.stop()
    print(f"\nload average {os.getloadavg()[0]:.1f}; target: HTTP / library <= 1.2 (paired median, wall)")
    for label, ratio in summary:
        print(f"| {label} | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", nargs="+", default=["programs", "ntk", "http"], choices=["programs", "ntk", "http"])
    parser.add_argument("--models", nargs="+", default=list(_models(False)), choices=list(_models(False)))
    parser.add_argument("--n", type=int, default=64, help="N = M of the programs part. Default: 64.")
    parser.add_argument("--n-http", type=int, default=256, help="N = M of the HTTP part. Default: 256.")
    parser.add_argument("--modes", nargs="+", default=["full", "trace"], choices=["full", "trace"])
    parser.add_argument("--rounds", type=int, default=5, help="Timed rounds after one warm-up. Default: 5.")
    parser.add_argument("--small", action="store_true", help="Small sizes for a quick check of the script.")
    parser.add_argument(
        "--base", type=Path, help="http part: also a server of this tree (an A/B, e.g. git archive HEAD~1 | tar -x)."
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # torch.export's and transformers' notices, per export
    torch.set_num_threads(2)
    retain_freed_memory()  # as the server
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    if "programs" in args.parts:
        programs_part(args.models, 8 if args.small else args.n, args.modes, args.rounds, args.small)
    if "ntk" in args.parts:
        ntk_part(args.rounds, args.small)
    if "http" in args.parts:
        http_part(16 if args.small else args.n_http, args.modes, args.rounds, args.small, args.base)


if __name__ == "__main__":
    main()
