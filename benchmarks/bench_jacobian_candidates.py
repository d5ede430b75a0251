"""Issue 37: exact ways to build one side's per-example Jacobians, against the engine's ``vmap(jacrev)`` side, at the
small N where AUTO's margin over the torch.func tutorial is thin (N = 16-32), alternating in one process.

At N = 16-32 AUTO runs the Jacobian contraction, whose time is its two ``vmap(jacrev)`` sides plus GEMMs at ~peak
rate, so a >= 1.1x margin over the tutorial needs a side built faster than ``vmap(jacrev)``. Each candidate below
computes the same Jacobians (checked in float64 against the engine's side, to 1e-10 relative) and is timed beside
the engine's side (``jacobian_chunks``: eval BatchNorm as its affine map, attention on its math path, strided 1x1
convolutions as a slice and a matmul):

- ``tutorial``: plain ``vmap(jacrev)``, as the tutorial (BatchNorm's own kernel);
- ``no_pointwise``: the engine's side without the strided 1x1 rewrite (``jacobian_chunks(pointwise=False)``);
- ``joint``: one ``vmap(jacrev)`` call over x1 and x2 together, against two calls (timed as two sides);
- ``im2col``: every ``conv2d`` as ``unfold`` + matmul (the per-example weight gradient a batched GEMM);
- ``channels_last``: 4-d parameters and inputs in channels-last memory format;
- ``group_norm``: ``F.group_norm`` from mean / var primitives (as ``affine_batchnorm`` does for BatchNorm).

Printed per case: median CPU seconds (user + system of this process) and candidate / engine (paired median of the
rounds' ratios: < 1, the candidate is faster), with the load average.

    .venv/bin/python benchmarks/bench_jacobian_candidates.py --variants resnet resnet_gn --sizes 16 32 --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE [OpenMP wait policy] in bench_structured.py

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT.parent), str(ROOT)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_auto_margin import variants  # noqa: E402
from torch import nn  # noqa: E402
from torch.func import functional_call, jacrev, vmap  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from ntk_service.kernels import retain_freed_memory  # noqa: E402
from ntk_service.kernels.jacobian_contraction import jacobian_chunks  # noqa: E402
from ntk_service.kernels.problem.affine_batchnorm import batchnorm_scope  # noqa: E402
from ntk_service.kernels.problem.math_attention import math_attention  # noqa: E402
from ntk_service.kernels.problem.pointwise_convolution import pointwise_scope  # noqa: E402
from ntk_service.kernels.runtime.problem_pool import prepared_problem  # noqa: E402

_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def _pair(v: Any) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, tuple | list) else (int(v), int(v))


class _Im2col(TorchFunctionMode):
    """``F.conv2d`` (groups 1, numeric padding) as unfold + matmul."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.conv2d:
            a = dict(zip(_CONV_ARGS, args, strict=False)) | kwargs
            x, w, bias = a["input"], a["weight"], a.get("bias")
            padding = a.get("padding", 0)
            one = w.shape[-2:] == (1, 1)
            if a.get("groups", 1) == 1 and not isinstance(padding, str):
                st, pd, dl = _pair(a.get("stride", 1)), _pair(padding), _pair(a.get("dilation", 1))
                co, ci, kh, kw = w.shape
                n, _, h, wd = x.shape
                ho = (h + 2 * pd[0] - dl[0] * (kh - 1) - 1) // st[0] + 1
                wo = (wd + 2 * pd[1] - dl[1] * (kw - 1) - 1) // st[1] + 1
                if one and pd == (0, 0):
                    cols = x[:, :, :: st[0], :: st[1]].reshape(n, ci, ho * wo)
                else:
                    cols = F.unfold(x, (kh, kw), dl, pd, st)
                out = (w.reshape(co, -1) @ cols).view(n, co, ho, wo)
                return out if bias is None else out + bias.view(1, -1, 1, 1)
        return func(*args, **kwargs)


class _GroupNorm(TorchFunctionMode):
    """``F.group_norm`` from ``var_mean`` and elementwise primitives."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.group_norm:
            a = dict(zip(("input", "num_groups", "weight", "bias", "eps"), args, strict=False)) | kwargs
            x, groups = a["input"], a["num_groups"]
            xg = x.reshape(x.shape[0], groups, -1)
            var, mean = torch.var_mean(xg, -1, keepdim=True, correction=0)
            y = ((xg - mean) * torch.rsqrt(var + a.get("eps", 1e-5))).reshape(x.shape)
            shape = (1, -1) + (1,) * (x.dim() - 2)
            if a.get("weight") is not None:
                y = y * a["weight"].view(shape)
            return y if a.get("bias") is None else y + a["bias"].view(shape)
        return func(*args, **kwargs)


def _side(
    model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, scopes: tuple[Callable[[], Any], ...]
) -> dict[str, torch.Tensor]:
    """name -> (n, k, p): ``vmap(jacrev)`` of ``functional_call`` over the examples of x, inside ``scopes``."""

    def f(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (xi.unsqueeze(0),)).squeeze(0)

    with contextlib.ExitStack() as stack:
        for scope in scopes:
            stack.enter_context(scope())
        out = vmap(jacrev(f), (None, 0))(params, x)
    return {k: j.flatten(2) for k, j in out.items()}


def contenders(
    model: nn.Module, x1: torch.Tensor, x2: torch.Tensor
) -> dict[str, Callable[[], list[dict[str, torch.Tensor]]]]:
    """name -> a call building the Jacobians of x1 and x2, as chunks name -> (c, k, p) in the order of the examples
    (never copied into one tensor, as the engine keeps them). ``engine`` is the Jacobian
    contraction's own two sides (``jacobian_chunks``); the others are ``vmap(jacrev)`` with the engine's scopes
    (BatchNorm as its affine map, attention on its math path) and a change each."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    engine_scopes = (lambda: batchnorm_scope(model), math_attention, lambda: pointwise_scope(model))

    def two(params: dict[str, torch.Tensor], a: torch.Tensor, b: torch.Tensor, *scopes: Callable[[], Any]) -> Any:
        def call() -> list[dict[str, torch.Tensor]]:
            return [_side(model, params, a, scopes), _side(model, params, b, scopes)]

        return call

    def engine(pointwise: bool = True) -> list[dict[str, torch.Tensor]]:
        with prepared_problem(model, x1, x2, params=None, dtype=None) as prepared:
            problem = prepared.problem
            a = jacobian_chunks(problem, prepared.x1, pointwise=pointwise)
            return [*a, *jacobian_chunks(problem, prepared.x2, pointwise=pointwise)]

    def joint() -> list[dict[str, torch.Tensor]]:
        return [_side(model, params, torch.cat([x1, x2]), engine_scopes)]

    out: dict[str, Callable[[], list[dict[str, torch.Tensor]]]] = {
        "engine": engine,
        "tutorial": two(params, x1, x2),
        "joint": joint,
    }
    if any(isinstance(m, nn.Conv2d) for m in model.modules()):
        out["no_pointwise"] = lambda: engine(pointwise=False)
        out["im2col"] = two(params, x1, x2, *engine_scopes, _Im2col)
        last = {k: v.contiguous(memory_format=torch.channels_last) if v.dim() == 4 else v for k, v in params.items()}
        x1c, x2c = (x.contiguous(memory_format=torch.channels_last) for x in (x1, x2))
        out["channels_last"] = two(last, x1c, x2c, *engine_scopes)
    if any(isinstance(m, nn.GroupNorm) for m in model.modules()):
        out["group_norm"] = two(params, x1, x2, *engine_scopes, _GroupNorm)
    return out


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _check(name: str, variant: Any) -> None:
    """Every candidate's Jacobians in float64 against the engine's, to 1e-10 relative (N = 3)."""
    build, inputs, _, _ = variant
    model = build().double()
    x1, x2 = (x if not x.is_floating_point() else x.double() for x in (inputs(3, 1), inputs(3, 2)))
    calls = contenders(model, x1, x2)

    def joined(chunks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}

    reference = joined(calls.pop("engine")())
    for key, call in calls.items():
        got = joined(call())
        for p, j in reference.items():
            error = float((got[p] - j).abs().max()) / max(float(j.abs().max()), 1e-300)
            assert error <= 1e-10, f"{name}: {key} differs from the engine's Jacobian of {p} ({error:.1e})"


def run_case(name: str, variant: Any, n: int, rounds: int, only: list[str] | None) -> dict[str, float]:
    build, inputs, _, _ = variant
    model = build()
    calls = contenders(model, inputs(n, 1), inputs(n, 2))
    calls = {key: call for key, call in calls.items() if only is None or key in only or key == "engine"}
    for call in calls.values():
        call()  # warm-up
    cpu: dict[str, list[float]] = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            start = _cpu()
            call()
            cpu[key].append(_cpu() - start)
    print(f"\n{name} N = M = {n}, two sides (load {os.getloadavg()[0]:.1f})")
    print("| contender | CPU s | contender / engine (CPU) |\n|---|---|---|")
    ratios = {}
    for key in calls:
        ratios[key] = statistics.median(a / b for a, b in zip(cpu[key], cpu["engine"], strict=True))
        print(f"| {key} | {statistics.median(cpu[key]):.3f} | {ratios[key]:.2f} |")
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=["resnet", "resnet_gn", "transformer"],
                        choices=list(variants(False)))  # fmt: skip
    parser.add_argument("--sizes", nargs="+", type=int, default=[16, 32])
    parser.add_argument("--rounds", type=int, default=5, help="Timed rounds after one warm-up. Default: 5.")
    parser.add_argument("--small", action="store_true", help="Small models and inputs for a quick check.")
    parser.add_argument("--only", nargs="+", help="Time only these contenders (and the engine). Default: all.")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # SDPA's vmap fallback in the tutorial's side
    torch.set_num_threads(2)
    retain_freed_memory()  # as the server
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds per case")
    summary = []
    for name in args.variants:
        _check(name, variants(True)[name])
        for n in args.sizes:
            summary.append((f"{name} N={n}", run_case(name, variants(args.small)[name], n, args.rounds, args.only)))
    keys = sorted({key for _, ratios in summary for key in ratios} - {"engine"})
    print("\nsummary: contender / engine, CPU, paired medians (< 1: faster than the engine's side)")
    print("| case | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for label, ratios in summary:
        print(f"| {label} | " + " | ".join(f"{ratios[k]:.2f}" if k in ratios else "-" for k in keys) + " |")


if __name__ == "__main__":
    main()
