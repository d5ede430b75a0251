"""The peer benchmark: Google's neural-tangents empirical NTK on the two benchmark models.

Runs INSIDE ``.peer-venv`` (``make peer-venv``: jax/jaxlib 0.4.25, numpy<2, neural-tangents 0.6.5), never in
the project's ``.venv``; it does not import torch. ``benchmarks/_peer.py`` launches it as a subprocess.

Models (exactly the torch models of ``benchmarks/_models.py``; NHWC images here, NCHW in torch):

- ``mlp``: 784-512-512-10, ReLU, biases (``stax``). ``mlp2048``: 784-2048-2048-10, the same otherwise.
- ``cnn``: input 3x32x32, conv 3x3 3->32, ReLU, conv 3x3 stride 2 32->32, ReLU, flatten, dense 6272->10; no
  padding ('VALID') (``stax``).
- ``resnet``: the CIFAR-style ResNet (widths 16, 32, 64; eval BatchNorm with constant statistics; 1x1 conv + BN
  shortcuts; global average pool; dense 64->10; P = 78,042), and ``transformer``: the two-layer pre-norm
  classifier (token + position embeddings, d = 128, 4 heads, packed in-projection, GELU (erf) d_ff = 512,
  final LayerNorm, mean over positions, dense 128->10; P = 434,954), both written in plain JAX
  (``_resnet_apply``, ``_transformer_apply``: stax has no eval BatchNorm or attention), parameters as a dict
  under torch's parameter names in JAX layout (dense (in, out), conv HWIO), BatchNorm statistics closed over
  as constants. ``empirical_ntk_fn`` takes any ``apply_fn(params, x)``; its structured derivatives analyse
  the jaxpr, whatever built it.

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
- ``--serve``: read lines ``MODEL N IMPLEMENTATION [MODE]`` from stdin and answer each with one JSON line
  ``{"seconds": ...}`` for ONE run (MODE: ``full`` or ``trace``, default full; compiled and warmed up on its
  first request, ``"compile_seconds"`` and ``"base_kib"`` then included; ``"vmhwm_kib"`` always), so a benchmark
  can alternate single runs of ours and the peer's: both see the same moments of a noisy machine
  (``_peer.PeerSession``).
- ``--check IN.npz --out OUT.npz``: load torch weights (Linear (out, in), Conv2d (out, in, kh, kw)) and inputs
  (NCHW) written by ``_models.export_weights_npz`` (ResNet and transformer: every parameter and buffer by its torch
  name), and write NT's full kernel ``theta`` (N, M, k, k) for
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

INPUT_SHAPES = {"mlp": (784,), "mlp2048": (784,), "cnn": (32, 32, 3), "resnet": (32, 32, 3), "transformer": (32,)}
"""Per-example input shape in NT's layout (NHWC images; torch's is (3, 32, 32)); token ids for the transformer."""

VOCAB_SIZE = 256
"""The transformer's token ids are below this (``_models.VOCAB_SIZE``)."""

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


_BN_EPS = 1e-5
"""torch's BatchNorm2d and LayerNorm default eps."""

_RESNET_WIDTHS = (16, 32, 64)
_TRANSFORMER = {"d": 128, "heads": 4, "d_ff": 512, "layers": 2, "t": 32, "k": 10}


def _resnet_blocks() -> list[tuple[str, int, int, int]]:
    """(prefix, c_in, c_out, stride) of each BasicBlock, as in ``_models.ResNet``."""
    blocks, c_in = [], _RESNET_WIDTHS[0]
    for i, width in enumerate(_RESNET_WIDTHS):
        blocks.append((f"blocks.{i}", c_in, width, 1 if i == 0 else 2))
        c_in = width
    return blocks


def _resnet_shapes() -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """Parameter name -> JAX shape (conv HWIO, dense (in, out)), and BatchNorm prefix -> channels."""
    shapes: dict[str, tuple[int, ...]] = {"stem.0.weight": (3, 3, 3, _RESNET_WIDTHS[0])}
    norms = {"stem.1": _RESNET_WIDTHS[0]}
    for prefix, c_in, c_out, stride in _resnet_blocks():
        shapes[f"{prefix}.conv1.weight"] = (3, 3, c_in, c_out)
        shapes[f"{prefix}.conv2.weight"] = (3, 3, c_out, c_out)
        norms[f"{prefix}.bn1"] = norms[f"{prefix}.bn2"] = c_out
        if stride != 1 or c_in != c_out:
            shapes[f"{prefix}.shortcut.0.weight"] = (1, 1, c_in, c_out)
            norms[f"{prefix}.shortcut.1"] = c_out
    for prefix, c in norms.items():
        shapes[f"{prefix}.weight"] = shapes[f"{prefix}.bias"] = (c,)
    shapes["head.weight"], shapes["head.bias"] = (_RESNET_WIDTHS[-1], 10), (10,)
    return shapes, norms


def _transformer_shapes() -> dict[str, tuple[int, ...]]:
    """Parameter name (torch's) -> JAX shape (dense weights (in, out))."""
    d, d_ff = _TRANSFORMER["d"], _TRANSFORMER["d_ff"]
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (VOCAB_SIZE, d), "position": (_TRANSFORMER["t"], d)}
    for layer in range(_TRANSFORMER["layers"]):
        prefix = f"encoder.{layer}"
        shapes |= {
            f"{prefix}.self_attn.in_proj_weight": (d, 3 * d),
            f"{prefix}.self_attn.in_proj_bias": (3 * d,),
            f"{prefix}.self_attn.out_proj.weight": (d, d),
            f"{prefix}.self_attn.out_proj.bias": (d,),
            f"{prefix}.linear1.weight": (d, d_ff),
            f"{prefix}.linear1.bias": (d_ff,),
            f"{prefix}.linear2.weight": (d_ff, d),
            f"{prefix}.linear2.bias": (d,),
        }
        for norm in ("norm1", "norm2"):
            shapes[f"{prefix}.{norm}.weight"] = shapes[f"{prefix}.{norm}.bias"] = (d,)
    shapes["norm.weight"] = shapes["norm.bias"] = (d,)
    shapes["head.weight"], shapes["head.bias"] = (d, _TRANSFORMER["k"]), (_TRANSFORMER["k"],)
    return shapes


def _random_params(shapes: dict[str, tuple[int, ...]], key: Any) -> dict[str, Any]:
    """Timing weights: N(0, 1/fan_in) matrices, norm scales near 1, small biases (the values do not change the time)."""
    params = {}
    for i, (name, shape) in enumerate(sorted(shapes.items())):
        sub = jax.random.fold_in(key, i)
        if len(shape) == 1:
            base = 1.0 if ("norm" in name or "bn" in name or name.startswith("stem.1")) and "weight" in name else 0.0
            params[name] = base + 0.1 * jax.random.normal(sub, shape)
        else:
            fan_in = int(np.prod(shape[:-1])) if name not in ("embed.weight", "position") else 1
            params[name] = jax.random.normal(sub, shape) / np.sqrt(fan_in)
    return params


def _conv2d(x: Any, w: Any, stride: int, pad: int) -> Any:
    # NHWC x, HWIO w: torch's nn.Conv2d (cross-correlation) with symmetric zero padding.
    return jax.lax.conv_general_dilated(
        x, w, (stride, stride), ((pad, pad), (pad, pad)), dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def _resnet_apply(statistics_: dict[str, tuple[Any, Any]]) -> Callable[..., Any]:
    """``apply_fn(params, x)`` of the ResNet, (n, 32, 32, 3) -> (n, 10); eval BatchNorm with the running
    (mean, var) of ``statistics_`` (BatchNorm prefix -> two (c,) arrays) as constants."""

    def bn(p: dict[str, Any], x: Any, prefix: str) -> Any:
        mean, var = statistics_[prefix]
        return (x - mean) * jax.lax.rsqrt(var + _BN_EPS) * p[f"{prefix}.weight"] + p[f"{prefix}.bias"]

    def apply_fn(p: dict[str, Any], x: Any, **_: Any) -> Any:
        y = jax.nn.relu(bn(p, _conv2d(x, p["stem.0.weight"], 1, 1), "stem.1"))
        for prefix, c_in, c_out, stride in _resnet_blocks():
            h = jax.nn.relu(bn(p, _conv2d(y, p[f"{prefix}.conv1.weight"], stride, 1), f"{prefix}.bn1"))
            h = bn(p, _conv2d(h, p[f"{prefix}.conv2.weight"], 1, 1), f"{prefix}.bn2")
            if stride != 1 or c_in != c_out:
                y = bn(p, _conv2d(y, p[f"{prefix}.shortcut.0.weight"], stride, 0), f"{prefix}.shortcut.1")
            y = jax.nn.relu(h + y)
        return y.mean(axis=(1, 2)) @ p["head.weight"] + p["head.bias"]

    return apply_fn


def _layer_norm(x: Any, weight: Any, bias: Any) -> Any:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + _BN_EPS) * weight + bias


def _transformer_apply(p: dict[str, Any], tokens: Any, **_: Any) -> Any:
    """The transformer, token ids (n, t) -> (n, 10): ``nn.TransformerEncoderLayer(norm_first=True, gelu)``."""
    d, heads = _TRANSFORMER["d"], _TRANSFORMER["heads"]
    n, t = tokens.shape
    h = p["embed.weight"][tokens] + p["position"][:t]
    for layer in range(_TRANSFORMER["layers"]):
        pre = f"encoder.{layer}"
        y = _layer_norm(h, p[f"{pre}.norm1.weight"], p[f"{pre}.norm1.bias"])
        qkv = y @ p[f"{pre}.self_attn.in_proj_weight"] + p[f"{pre}.self_attn.in_proj_bias"]
        q, k, v = (a.reshape(n, t, heads, d // heads).transpose(0, 2, 1, 3) for a in jnp.split(qkv, 3, axis=-1))
        scores = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / np.sqrt(d // heads), axis=-1)
        attended = (scores @ v).transpose(0, 2, 1, 3).reshape(n, t, d)
        h = h + attended @ p[f"{pre}.self_attn.out_proj.weight"] + p[f"{pre}.self_attn.out_proj.bias"]
        y = _layer_norm(h, p[f"{pre}.norm2.weight"], p[f"{pre}.norm2.bias"])
        y = jax.nn.gelu(y @ p[f"{pre}.linear1.weight"] + p[f"{pre}.linear1.bias"], approximate=False)
        h = h + y @ p[f"{pre}.linear2.weight"] + p[f"{pre}.linear2.bias"]
    pooled = _layer_norm(h, p["norm.weight"], p["norm.bias"]).mean(axis=1)
    return pooled @ p["head.weight"] + p["head.bias"]


def build_model(
    name: str, buffers: dict[str, np.ndarray] | None = None
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Return ``(init_fn, apply_fn)`` of the benchmark model ``name`` (one of ``INPUT_SHAPES``).

    ``init_fn(key, input_shape) -> (output_shape, params)`` as stax's. ``buffers``: the ResNet's BatchNorm
    running statistics under torch's names (``<prefix>.running_mean``/``running_var``); default: random ones.
    """
    if name in ("resnet", "transformer"):
        shapes, norms = _resnet_shapes() if name == "resnet" else (_transformer_shapes(), {})
        if buffers is None:
            generator = np.random.default_rng(_SEED)
            statistics_ = {
                prefix: (0.1 * generator.standard_normal(c), 0.5 + generator.random(c)) for prefix, c in norms.items()
            }
        else:
            statistics_ = {
                prefix: (buffers[f"{prefix}.running_mean"], buffers[f"{prefix}.running_var"]) for prefix in norms
            }
        statistics_ = {
            key: (jnp.asarray(m, jnp.float32), jnp.asarray(v, jnp.float32)) for key, (m, v) in statistics_.items()
        }

        def init_fn(key: Any, input_shape: tuple[int, ...]) -> tuple[tuple[int, ...], dict[str, Any]]:
            return (input_shape[0], 10), _random_params(shapes, key)

        return init_fn, _resnet_apply(statistics_) if name == "resnet" else _transformer_apply
    if name in ("mlp", "mlp2048"):
        width = 512 if name == "mlp" else 2048
        layers = [_dense(width), stax.Relu(), _dense(width), stax.Relu(), _dense(10)]
    elif name == "cnn":
        layers = [_conv(32, 1), stax.Relu(), _conv(32, 2), stax.Relu(), stax.Flatten(), _dense(10)]
    else:
        raise ValueError(f"peer_neural_tangents: unknown model {name!r}; expected one of {sorted(INPUT_SHAPES)}")
    init_fn, apply_fn, _ = stax.serial(*layers)
    return init_fn, apply_fn


def _inputs(name: str, n: int, key: Any) -> Any:
    """Timing inputs (n, *INPUT_SHAPES[name]): standard normal, or token ids for the transformer."""
    if name == "transformer":
        return jax.random.randint(key, (n, *INPUT_SHAPES[name]), 0, VOCAB_SIZE)
    return jax.random.normal(key, (n, *INPUT_SHAPES[name]))


MODES = {"full": (), "trace": (-1,)}
"""Our mode name -> NT's ``trace_axes``: FULL keeps both output axes (N, M, k, k); TRACE traces them (N, M)
(NT averages over the k outputs where ours sums: the same work)."""


def _ntk_fn(apply_fn: Callable[..., Any], implementation: str, mode: str = "full") -> Callable[..., Any]:
    # vmap_axes=0 is NT's own "for best performance" advice (examples are independent along axis 0 for all models).
    fn = nt.empirical_ntk_fn(
        apply_fn, trace_axes=MODES[mode], vmap_axes=0, implementation=IMPLEMENTATIONS[implementation]
    )
    return jax.jit(fn)


def _high_water_kib() -> int:
    """This process's peak RSS so far (VmHWM, KiB)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _compiled(name: str, n: int, implementation: str, mode: str = "full") -> tuple[Callable[[], Any], float, float]:
    """The kernel as a no-argument call (inputs and parameters bound), compile and warm-up seconds."""
    init_fn, apply_fn = build_model(name)
    key_params, key_x1, key_x2 = jax.random.split(jax.random.PRNGKey(_SEED), 3)
    _, params = init_fn(key_params, (-1, *INPUT_SHAPES[name]))
    x1, x2 = _inputs(name, n, key_x1), _inputs(name, n, key_x2)

    start = time.perf_counter()
    compiled = _ntk_fn(apply_fn, implementation, mode).lower(x1, x2, params).compile()  # ahead of time
    compile_seconds = time.perf_counter() - start

    def call() -> Any:
        return compiled(x1, x2, params).block_until_ready()

    start = time.perf_counter()
    theta = call()  # warm-up
    warmup_seconds = time.perf_counter() - start
    assert theta.shape == ((n, n, 10, 10) if mode == "full" else (n, n)), theta.shape
    return call, compile_seconds, warmup_seconds


def serve() -> None:
    """Answer ``MODEL N IMPLEMENTATION [MODE]`` lines on stdin with one timed run each (see ``--serve``); each answer
    also carries the process's VmHWM (KiB) so far, the first of a case VmHWM before it was built (``base_kib``)."""
    calls: dict[tuple[str, int, str, str], Callable[[], Any]] = {}
    for line in sys.stdin:
        name, n_text, implementation, *rest = line.split()
        key = (name, int(n_text), implementation, rest[0] if rest else "full")
        row: dict[str, Any] = {}
        if key not in calls:
            row["base_kib"] = _high_water_kib()
            calls[key], row["compile_seconds"], row["warmup_seconds"] = _compiled(*key)
        start = time.perf_counter()
        calls[key]()
        row["seconds"] = time.perf_counter() - start
        row["vmhwm_kib"] = _high_water_kib()
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


def _named_params_from_torch(name: str, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """The ResNet's or transformer's ``param:<torch name>`` arrays in JAX layout (conv HWIO, dense (in, out))."""
    shapes = _resnet_shapes()[0] if name == "resnet" else _transformer_shapes()
    params = {}
    for key, shape in shapes.items():
        value = arrays[f"param:{key}"]
        if value.ndim == 4:  # Conv2d (out, in, kh, kw) -> HWIO
            value = value.transpose(2, 3, 1, 0)
        elif value.ndim == 2 and key not in ("embed.weight", "position"):  # Linear (out, in) -> (in, out)
            value = value.T
        if value.shape != shape:
            raise ValueError(f"peer_neural_tangents --check: {key} has shape {value.shape}, expected {shape}")
        params[key] = jnp.asarray(value)
    return params


def run_check(in_path: str, out_path: str, implementations: Sequence[str]) -> None:
    """Write NT's full kernel for the torch weights/inputs in ``in_path`` to ``out_path`` (theta_<impl>)."""
    with np.load(in_path) as data:
        arrays = {key: data[key] for key in data.files}
    name = str(arrays.pop("model"))
    x1, x2 = arrays.pop("x1"), arrays.pop("x2")
    if x1.ndim == 4:  # NCHW -> NHWC
        x1, x2 = x1.transpose(0, 2, 3, 1), x2.transpose(0, 2, 3, 1)
    if name in ("resnet", "transformer"):
        buffers = {key[len("buffer:") :]: value for key, value in arrays.items() if key.startswith("buffer:")}
        _, apply_fn = build_model(name, buffers)
        params: Any = _named_params_from_torch(name, arrays)
    else:
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
