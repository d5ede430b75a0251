#!/usr/bin/env bash
# One GPU session in one go: report the torch/CUDA there, run tests/gpu, then benchmarks/bench_gpu.py, with every
# log and result under $OUT (default /tmp/ntk-gpu-out). Run from the repository root on the GPU machine:
#
#     OUT=/some/dir bash benchmarks/gpu_session.sh
#
# It uses the torch already installed there (a CUDA build; nothing is downloaded: the machine may reach no index).
# The service's other dependencies (fastapi, uvicorn, httpx, pydantic-settings, safetensors, zarr, ...) come from
# that Python too, or from a wheelhouse carried along in .gpu-wheels/ (see docs/gpu.md), installed offline into a
# venv that sees the system's torch. Whatever is missing is reported and the steps that need it are skipped.
#
# Environment: PYTHON (default python3), OUT, TEST_TIMEOUT_S (default 240), BENCH_TIMEOUT_S (default 300),
# BENCH_ARGS (extra bench_gpu.py arguments, e.g. "--sizes 64 256"); CHECK_ON_CPU=1 runs every step on a machine
# without CUDA (the tests skip, the benchmark runs with --device cpu at tiny sizes): a check of this script only.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/ntk-gpu-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
TEST_TIMEOUT_S="${TEST_TIMEOUT_S:-240}"
BENCH_TIMEOUT_S="${BENCH_TIMEOUT_S:-300}"
exec > >(tee "$OUT/session.log") 2>&1
echo "== gpu_session $(date -u +%FT%TZ) on $(hostname) in $PWD"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>&1 || echo "nvidia-smi: not available"

if [ -d .gpu-wheels ]; then
    echo "== installing the carried wheelhouse into .gpu-venv (offline, system torch visible)"
    "$PY" -m venv --system-site-packages .gpu-venv && PY="$PWD/.gpu-venv/bin/python"
    "$PY" -m pip install -q --no-index --find-links .gpu-wheels .gpu-wheels/*.whl 2>&1 | tail -5
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from the source tree: no install needed
export RAY_USAGE_STATS_ENABLED=0

echo "== torch"
"$PY" - <<'EOF' | tee "$OUT/torch.txt"
import torch
print("torch", torch.__version__, "torch.version.cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print("device 0", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
    print("tf32 defaults: matmul", torch.backends.cuda.matmul.allow_tf32, "cudnn", torch.backends.cudnn.allow_tf32)
EOF
DEVICE_ARGS=""
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    if [ "${CHECK_ON_CPU:-0}" != 1 ]; then
        echo "== no usable CUDA here (see above): nothing to measure; stopping"
        exit 2
    fi
    echo "== CHECK_ON_CPU=1: no CUDA; checking the script's steps on the CPU (nothing is measured)"
    DEVICE_ARGS="--device cpu --sizes 4 --repeats 1 --http-n 4"
fi

echo "== dependencies"
MISSING=$("$PY" - <<'EOF'
import importlib.util
mods = ["numpy", "pytest", "httpx", "fastapi", "uvicorn", "pydantic", "pydantic_settings", "safetensors", "zarr",
        "orjson", "typer", "prometheus_client", "tqdm", "anyio"]
print(" ".join(m for m in mods if importlib.util.find_spec(m) is None))
EOF
)
echo "missing: ${MISSING:-none}"
SERVER_DEPS=1
for m in httpx fastapi uvicorn pydantic_settings safetensors zarr orjson prometheus_client; do
    case " $MISSING " in *" $m "*) SERVER_DEPS=0 ;; esac
done

echo "== tests/gpu (timeout ${TEST_TIMEOUT_S}s)"
case " $MISSING " in
    *" pytest "* | *" numpy "*) echo "skipped: pytest or numpy missing" ;;
    *)
        if [ "$SERVER_DEPS" = 1 ]; then
            # -W default: report warnings instead of failing on them (another torch build may warn differently)
            timeout "$TEST_TIMEOUT_S" "$PY" -m pytest tests/gpu -v -rs -W default -p no:cacheprovider \
                --junitxml="$OUT/tests-gpu.xml" 2>&1 | tee "$OUT/tests-gpu.log"
            echo "pytest exit ${PIPESTATUS[0]}"
        else
            echo "skipped: the test module needs the service's dependencies (missing: $MISSING)"
        fi
        ;;
esac

echo "== benchmarks/bench_gpu.py (timeout ${BENCH_TIMEOUT_S}s)"
HTTP_ARG=""
[ "$SERVER_DEPS" = 1 ] || { HTTP_ARG="--http-n 0"; echo "(no HTTP kernel: server dependencies missing)"; }
# shellcheck disable=SC2086
timeout "$BENCH_TIMEOUT_S" "$PY" benchmarks/bench_gpu.py --out "$OUT/bench_gpu.json" $DEVICE_ARGS $HTTP_ARG \
    ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/bench_gpu.log"
echo "bench_gpu exit ${PIPESTATUS[0]}"
echo "== done $(date -u +%FT%TZ): results in $OUT"
