"""Upload and load time of an exported model (issue 24): a ``GatedLoop`` class (a ModuleList of Linear layers, a gate
parameter) of about 10M parameters, timed stage by stage in one run.

- ``export``: ``torch.export.export`` + ``torch.export.save`` to bytes (what ``Client.register_module`` does locally);
- ``load_exported``: the service's checked loader on those bytes, in this process (zip checks, raw tensors,
  JSON checks, torch's deserializer, ``.module()``);
- ``torch.export.load``: torch's own (unsafe) loader on the same bytes plus ``.module()``, for the ratio only;
- ``upload``: ``POST /v1/models/exported`` to a real uvicorn server on loopback (the multipart body, the server's
  checked load, the probe forward, storing the archive and version 1), round trip;
- ``load_module``: a fresh ``ModelRegistry`` on the server's data directory loading the stored model (what a
  kernel request pays on a cache miss: the checked load of the stored archive plus copying version 1's weights).

Medians over rounds; the machine may be shared, so say so beside any number.

    .venv/bin/python benchmarks/bench_exported.py                       # ~10M parameters, 3 rounds
    .venv/bin/python benchmarks/bench_exported.py --width 64 --rounds 1  # a small smoke run
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ntk_service.client._export import export_module, multipart_body  # noqa: E402
from ntk_service.registry import ModelRegistry  # noqa: E402
from ntk_service.registry.exported import load_exported  # noqa: E402
from tests.conftest import start_live_server  # noqa: E402
from tests.registry.exported_models import GatedLoop  # noqa: E402


def _timed(fn: Callable[[], object], rounds: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(rounds):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1000, help="Linear width. Default: 1000 (10 blocks: ~10M).")
    parser.add_argument("--depth", type=int, default=10, help="Blocks in the ModuleList. Default: 10.")
    parser.add_argument("--rounds", type=int, default=3, help="Timed rounds per stage. Default: 3.")
    args = parser.parse_args()

    torch.manual_seed(0)
    module = GatedLoop(width=args.width, depth=args.depth, classes=10).eval()
    params = sum(p.numel() for p in module.parameters())
    shape = (args.width,)
    t_export, data = _timed(lambda: export_module(module, input_shape=shape, input_dtype="float32"), args.rounds)
    assert isinstance(data, bytes)
    t_load, _ = _timed(lambda: load_exported(data, operation="bench"), args.rounds)
    t_torch, _ = _timed(lambda: torch.export.load(io.BytesIO(data)).module(), args.rounds)

    with tempfile.TemporaryDirectory() as tmp:
        server = start_live_server(Path(tmp) / "data", keys=False, max_body_bytes=str(2 * len(data) + (1 << 20)))
        try:
            names: list[str] = []

            def upload() -> None:
                name = f"bench-{uuid.uuid4().hex[:8]}"
                body, content_type = multipart_body({"name": name}, {"program": ("model.pt2", data)})
                with server.client(None, timeout=600.0) as http:
                    response = http.post("/v1/models/exported", content=body, headers={"Content-Type": content_type})
                assert response.status_code == 201, response.text
                names.append(name)

            t_upload, _ = _timed(upload, args.rounds)
            registry = ModelRegistry(Path(tmp) / "data", module_cache_size=0)
            try:
                t_module, _ = _timed(lambda: registry.load_module(names[0]), args.rounds)
            finally:
                registry.close()
        finally:
            server.stop()

    mib = len(data) / 2**20
    print(f"GatedLoop width {args.width} depth {args.depth}: {params:,} parameters, archive {mib:.1f} MiB")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.rounds} rounds")
    rows = [
        ("export (client: export + save)", t_export),
        ("load_exported (checked, in process)", t_load),
        ("torch.export.load + .module() (unsafe)", t_torch),
        ("upload: POST /v1/models/exported round trip", t_upload),
        ("load_module (fresh registry, cache miss)", t_module),
    ]
    for label, seconds in rows:
        print(f"  {label:<46} {seconds:8.3f} s")
    print(f"  load_exported / torch.export.load            {t_load / t_torch:8.2f}x")


if __name__ == "__main__":
    main()
