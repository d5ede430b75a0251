"""Our ``jacobian_contraction`` against the torch.func tutorial's, alternating in one process.

Both spend most of their time in the same ``vmap(jacrev)``, so on a shared machine the per-process numbers of
``bench_kernels.py`` mostly measure load; alternating the two calls in one process compares them fairly.

    .venv/bin/python benchmarks/bench_contraction_ab.py mlp full 64
    .venv/bin/python benchmarks/bench_contraction_ab.py cnn trace 256 --repeats 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

from _models import MODELS, make_inputs  # noqa: E402
from torchfunc_tutorial import tutorial_ntk  # noqa: E402

from ntk_service.kernels import compute_ntk  # noqa: E402

_TUTORIAL_COMPUTE = {"full": "full", "trace": "trace", "output_diagonal": "diagonal"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("mode", choices=sorted(_TUTORIAL_COMPUTE))
    parser.add_argument("n", type=int)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    model = MODELS[args.model]()
    x1, x2 = make_inputs(args.model, args.n), make_inputs(args.model, args.n, seed=2)

    def ours() -> int:
        return compute_ntk(model, x1, x2, mode=args.mode, implementation="jacobian_contraction").block_size

    def tutorial() -> None:
        tutorial_ntk(model, x1, x2, _TUTORIAL_COMPUTE[args.mode])

    ours(), tutorial()  # warm-up
    times: dict[str, list[float]] = {"tutorial": [], "ours": []}
    for _ in range(args.repeats):
        for name, call in (("tutorial", tutorial), ("ours", ours)):
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    t, o = statistics.median(times["tutorial"]), statistics.median(times["ours"])
    print(f"{args.model} {args.mode} N=M={args.n}: tutorial {t:.3f} s, ours {o:.3f} s, tutorial/ours {t / o:.2f}")


if __name__ == "__main__":
    main()
