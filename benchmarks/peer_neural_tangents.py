"""The peer benchmark: Google's neural-tangents empirical NTK on the two benchmark models.

Runs INSIDE ``.peer-venv`` (``make peer-venv``: jax/jaxlib 0.4.25, numpy<2, neural-tangents 0.6.5), never in
the project's ``.venv``; it does not import torch. ``benchmarks/_peer.py`` launches it as a subprocess.

Models (built with ``stax``, exactly the torch models of ``benchmarks/_models.py``):

- ``mlp``: 784-512-512-10, ReLU, biases.
- ``cnn``: input 3x32x32 (NHWC here, NCHW in torch), conv 3x3 3->32, ReLU, conv 3x3 stride 2 32->32, ReLU,
  flatten, dense 6272->10; no padding ('VALID').

Every ``stax.Dense``/``stax.Conv`` uses ``parameterization='standard'``: its apply function is then exactly
``y = x W + b`` (``s = (1, 1)``), the semantics of torch's ``nn.Linear``/``nn.Conv2d`` (W_std/b_std only
scale the initialisation; b_std must be non-None so the layer has a bias). Under the default 'ntk'
parameterization the apply function multiplies by W_std / sqrt(fan_in) and the kernels would differ.

Two modes:

- timing (default): for each model x N (= M) x implementation, jit ``empirical_ntk_fn(apply_fn,
  trace_axes=(), vmap_axes=0, implementation=...)`` (the full kernel, (N, M, k, k)), compile it ahead of
  time, run it once to warm up, then time up to ``--repeats`` runs with ``block_until_ready``
  (stopping once they add up to ``--max-seconds``; only one when the warm-up took over half of it)
  and print one JSON object per line: ``{"model", "n", "implementation", "seconds", ...}`` (``seconds`` is
  the median). Combinations in ``SKIPPED_BY_DEFAULT``, or whose time extrapolated as N^2 from the largest
  smaller N would exceed ``PREDICTION_SLACK`` x ``--max-seconds``, are not run: they print
  ``"seconds": null`` and ``"skipped"``.
- ``--serve``: read lines ``MODEL N IMPLEMENTATION`` from stdin and answer each with one JSON line
  ``{"seconds": ...}`` for ONE run (compiled and warmed up on its first request, ``"compile_seconds"`` then
  included), so a benchmark can alternate single runs of ours and the peer's: both see the same moments of a
  noisy machine (``_peer.PeerSession``).
- ``--check IN.npz --out OUT.npz``: load torch weights (Linear (out, in), Conv2d (out, in, kh, kw)) and inputs
  (NCHW) written by ``_models.export_weights_npz``, and write NT's full kernel ``theta`` (N, M, k, k) for
  each implementation to OUT.npz (keys ``theta_<implementation>``), so the torch side can compare numbers.

Usage::

    .peer-venv/bin/python benchmarks/peer_neural_tangents.py --models mlp cnn --sizes 64 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

# NOTE [stubbing neural_tangents.experimental]
# `import neural_tangents` runs `from . import experimental`, whose only content is the TensorFlow bridge
# (`empirical_ntk_fn_tf`): it imports tensorflow, tf2jax and jax2tf (which needs absl) at import time. None of
# it is used here, and installing TensorFlow only to import it is ~600 MB. An empty package registered in
# sys.modules under that name before the import satisfies `from . import experimental` (Python falls back to
# sys.modules for `from package import submodule`) and keeps the rest of neural-tangents untouched; any use
# of `nt.experimental.*` fails loudly with AttributeError/ModuleNotFoundError rather than silently.
_experimental_stub = types.ModuleType("neural_tangents.experimental")
_experimental_stub.__path__ = []
sys.modules.setdefault("neural_tangents.experimental", _experimental_stub)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import neural_tangents as nt  # noqa: E402
import numpy as np  # noqa: E402
from neural_tangents import stax  # noqa: E402

IMPLEMENTATIONS = {
    "jacobian_contraction": nt.NtkImplementation.JACOBIAN_CONTRACTION,
    "ntk_vector_products": nt.NtkImplementation.NTK_VECTOR_PRODUCTS,
    "structured_derivatives": nt.NtkImplementation.STRUCTURED_DERIVATIVES,
}
"""Our names (the values of ``NtkImplementation`` on the wire) -> neural-tangents' enum."""

INPUT_SHAPES = {"mlp": (784,), "cnn": (32, 32, 3)}
"""Per-example input shape in NT's layout (NHWC for the CNN; torch's is (3, 32, 32))."""

DEFAULT_MAX_SECONDS = 60.0
"""Seconds per combination: caps the timed runs and skips predicted-slower ones (2 cores, shared)."""

DEFAULT_REPEATS = 3
"""Timed runs after the warm-up; the median is reported (CPU is shared, a single run is too noisy)."""

SKIPPED_BY_DEFAULT = {
    ("mlp", "jacobian_contraction", 256): "measured 7.7-20 s at N=64, so 2-5 min at 256 (J is 2 x 6.9 GB)",
    ("cnn", "jacobian_contraction", 256): "measured 103 s per run (2.2 s at N=64)",
    ("cnn", "ntk_vector_products", 256): "measured 45-54 s at N=64, so ~15 min at 256",
}
"""Combinations measured (2-core machine, shared, 2026-11-29) at > 60 s per run: not run by default.

Beyond these, a combination is skipped when its time extrapolated as N^2 from a smaller N exceeds
``PREDICTION_SLACK`` x ``--max-seconds``. The extrapolation is only a coarse guard: it overestimates NTK-vector
products on the MLP (2.6 s at N=64 -> 12.5 s at 256, 4.8x, not 16x) and underestimates the Jacobian
contraction on the CNN (2.2 s -> 103 s, 47x), so the measured decisions live in this table.
"""

PREDICTION_SLACK = 2.0
"""The N^2 guard skips only beyond this multiple of --max-seconds (see SKIPPED_BY_DEFAULT for why it's loose)."""

_SEED = 0


def _dense(out: int) -> Any:
    # 'standard' + b_std not None: apply is x @ W + b with W (in, out), b (1, out), i.e. nn.Linear.
    return stax.Dense(out, W_std=1.0, b_std=1.0, parameterization="standard")


def _conv(out: int, stride: int) -> Any:
    # NHWC input, HWIO kernel, cross-correlation like nn.Conv2d; b (1, 1, 1, out).
    return stax.Conv(
        out,
        (3, 3),
        strides=(stride, stride),
        padding="VALID",
        W_std=1.0,
        b_std=1.0,
        parameterization="standard",
    )


def build_model(name: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Return ``(init_fn, apply_fn)`` of the benchmark model ``name`` ('mlp' or 'cnn')."""
    if name == "mlp":
        layers = [_dense(512), stax.Relu(), _dense(512), stax.Relu(), _dense(10)]
    elif name == "cnn":
        layers = [_conv(32, 1), stax.Relu(), _conv(32, 2), stax.Relu(), stax.Flatten(), _dense(10)]
    else:
        raise ValueError(f"peer_neural_tangents: unknown model {name!r}; expected one of {sorted(INPUT_SHAPES)}")
    init_fn, apply_fn, _ = stax.serial(*layers)
    return init_fn, apply_fn


def _ntk_fn(apply_fn: Callable[..., Any], implementation: str) -> Callable[..., Any]:
    # trace_axes=() keeps both output axes: theta (N, M, k, k). vmap_axes=0 is NT's own "for best
    # performance" advice (examples are independent along axis 0 for both models).
    fn = nt.empirical_ntk_fn(apply_fn, trace_axes=(), vmap_axes=0, implementation=IMPLEMENTATIONS[implementation])
    return jax.jit(fn)


def _compiled(name: str, n: int, implementation: str) -> tuple[Callable[[], Any], float, float]:
    """The kernel as a no-argument call (inputs and parameters bound), compile and warm-up seconds."""
    init_fn, apply_fn = build_model(name)
    key_params, key_x1, key_x2 = jax.random.split(jax.random.PRNGKey(_SEED), 3)
    _, params = init_fn(key_params, (-1, *INPUT_SHAPES[name]))
    x1 = jax.random.normal(key_x1, (n, *INPUT_SHAPES[name]))
    x2 = jax.random.normal(key_x2, (n, *INPUT_SHAPES[name]))

    start = time.perf_counter()
    compiled = _ntk_fn(apply_fn, implementation).lower(x1, x2, params).compile()  # ahead of time
    compile_seconds = time.perf_counter() - start

    def call() -> Any:
        return compiled(x1, x2, params).block_until_ready()

    start = time.perf_counter()
    theta = call()  # warm-up
    warmup_seconds = time.perf_counter() - start
    assert theta.shape == (n, n, 10, 10), theta.shape
    return call, compile_seconds, warmup_seconds


def serve() -> None:
    """Answer ``MODEL N IMPLEMENTATION`` lines on stdin with one timed run each (see ``--serve``)."""
    calls: dict[tuple[str, int, str], Callable[[], Any]] = {}
    for line in sys.stdin:
        name, n_text, implementation = line.split()
        key = (name, int(n_text), implementation)
        row: dict[str, Any] = {}
        if key not in calls:
            calls[key], row["compile_seconds"], row["warmup_seconds"] = _compiled(*key)
        start = time.perf_counter()
        calls[key]()
        row["seconds"] = time.perf_counter() - start
        print(json.dumps(row), flush=True)


def _time_one(name: str, n: int, implementation: str, repeats: int, max_seconds: float) -> dict[str, Any]:
    call, compile_seconds, warmup_seconds = _compiled(name, n, implementation)

    row = {"model": name, "n": n, "implementation": implementation}
    runs: list[float] = []
    budget_repeats = repeats
    if warmup_seconds > max_seconds / 2:
        # Slow: one timed run after the warm-up. Not the warm-up itself: JAX's first run of a big program
        # can take 2x the steady state (buffer allocation; mlp/ntk_vector_products at N=256: 23.8 s, then 12.5 s).
        budget_repeats = 1
        row["note"] = f"one timed run: warm-up took > --max-seconds/2 = {max_seconds / 2:g} s"
    while len(runs) < budget_repeats and sum(runs) <= max_seconds:
        start = time.perf_counter()
        call()
        runs.append(time.perf_counter() - start)
    return {
        **row,
        "seconds": statistics.median(runs),
        "runs": runs,
        "compile_seconds": compile_seconds,
        "warmup_seconds": warmup_seconds,
    }


def _skip_reason(
    name: str, n: int, implementation: str, measured: tuple[int, float] | None, max_seconds: float, use_skips: bool
) -> str | None:
    if use_skips and (name, implementation, n) in SKIPPED_BY_DEFAULT:
        return SKIPPED_BY_DEFAULT[name, implementation, n] + " (run it with --no-default-skips)"
    if measured is not None:
        predicted = measured[1] * (n / measured[0]) ** 2
        if predicted > PREDICTION_SLACK * max_seconds:
            return (
                f"predicted {predicted:.0f} s > {PREDICTION_SLACK:g} x --max-seconds {max_seconds:g} "
                f"(N^2 from {measured[1]:.2f} s at N={measured[0]})"
            )
    return None


def run_timings(
    models: Sequence[str],
    sizes: Sequence[int],
    implementations: Sequence[str],
    repeats: int,
    max_seconds: float,
    use_skips: bool = True,
) -> None:
    """Print one JSON line per (model, N, implementation), smallest N first."""
    for name in models:
        for implementation in implementations:
            measured: tuple[int, float] | None = None  # (n, seconds) of the largest N run so far
            for n in sorted(sizes):
                reason = _skip_reason(name, n, implementation, measured, max_seconds, use_skips)
                if reason is not None:
                    row: dict[str, Any] = {"model": name, "n": n, "implementation": implementation}
                    print(json.dumps({**row, "seconds": None, "skipped": reason}), flush=True)
                    continue
                row = _time_one(name, n, implementation, repeats, max_seconds)
                measured = (n, row["seconds"])
                print(json.dumps(row), flush=True)


def _params_from_torch(name: str, arrays: dict[str, np.ndarray], reference: Any) -> list[Any]:
    """Convert the torch layers' weights (in forward order) to stax params shaped like ``reference``."""
    torch_layers = sorted({key.split("_")[0] for key in arrays if key.startswith("layer")}, key=lambda s: int(s[5:]))
    converted = []
    layer_iter = iter(torch_layers)
    for ref in reference:
        if ref == ():  # Relu / Flatten
            converted.append(())
            continue
        layer = next(layer_iter)
        weight, bias = arrays[f"{layer}_weight"], arrays[f"{layer}_bias"]
        w_ref, b_ref = ref
        if weight.ndim == 4:  # Conv2d (out, in, kh, kw) -> HWIO
            weight = weight.transpose(2, 3, 1, 0)
        else:  # Linear (out, in) -> (in, out)
            weight = weight.T
            if name == "cnn" and weight.shape[0] == 6272:
                # torch flattens (C, H, W), stax.Flatten flattens NHWC as (H, W, C): permute the rows.
                weight = weight.reshape(32, 14, 14, -1).transpose(1, 2, 0, 3).reshape(6272, -1)
        bias = bias.reshape(b_ref.shape)
        if weight.shape != w_ref.shape:
            raise ValueError(f"peer_neural_tangents --check: {layer} weight {weight.shape}, stax expects {w_ref.shape}")
        converted.append((jnp.asarray(weight), jnp.asarray(bias)))
    if next(layer_iter, None) is not None:
        raise ValueError("peer_neural_tangents --check: the npz has more layers than the stax model")
    return converted


def run_check(in_path: str, out_path: str, implementations: Sequence[str]) -> None:
    """Write NT's full kernel for the torch weights/inputs in ``in_path`` to ``out_path`` (theta_<impl>)."""
    with np.load(in_path) as data:
        arrays = {key: data[key] for key in data.files}
    name = str(arrays.pop("model"))
    x1, x2 = arrays.pop("x1"), arrays.pop("x2")
    if x1.ndim == 4:  # NCHW -> NHWC
        x1, x2 = x1.transpose(0, 2, 3, 1), x2.transpose(0, 2, 3, 1)
    init_fn, apply_fn = build_model(name)
    _, reference = init_fn(jax.random.PRNGKey(_SEED), (-1, *INPUT_SHAPES[name]))
    params = _params_from_torch(name, arrays, reference)
    out = {}
    for implementation in implementations:
        theta = _ntk_fn(apply_fn, implementation)(jnp.asarray(x1), jnp.asarray(x2), params)
        out[f"theta_{implementation}"] = np.asarray(theta)
    np.savez(out_path, **out)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=sorted(INPUT_SHAPES))
    parser.add_argument("--sizes", nargs="+", type=int, default=[64, 256], help="N = M values")
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS), choices=list(IMPLEMENTATIONS))
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    parser.add_argument("--max-seconds", type=float, default=DEFAULT_MAX_SECONDS)
    parser.add_argument(
        "--no-default-skips", action="store_true", help="also run the combinations in SKIPPED_BY_DEFAULT"
    )
    parser.add_argument("--check", metavar="IN.npz", help="torch weights and inputs from export_weights_npz")
    parser.add_argument("--out", metavar="OUT.npz", help="where --check writes theta_<implementation>")
    parser.add_argument("--serve", action="store_true", help="time single runs requested on stdin")
    args = parser.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")
    if args.serve:
        serve()
    elif args.check:
        if not args.out:
            parser.error("--check needs --out OUT.npz")
        run_check(args.check, args.out, args.implementations)
    else:
        run_timings(
            args.models,
            args.sizes,
            args.implementations,
            args.repeats,
            args.max_seconds,
            use_skips=not args.no_default_skips,
        )


if __name__ == "__main__":
    main()
