#!/usr/bin/env bash
# End-to-end smoke test of the Docker image (not part of CI: it needs root, a Docker engine, minutes).
#
#   sudo docker/smoke-test.sh
#
# 1. Docker engine: uses $DOCKER_HOST if it answers; otherwise installs docker.io from Debian if needed and
#    starts its own dockerd on a private socket under $NTK_DOCKER_CACHE (stopped by PID at the end).
# 2. Base image: docker/make-base-image.sh (debootstrap bookworm, cached), since no image registry may be
#    reachable. NTK_SMOKE_BASE_IMAGE=python:3.11-slim skips that where one is.
# 3. Builds the image (legacy builder), with the local torch wheel passed through WHEELS_DIR (--find-links).
# 4. Runs it with a named volume and API keys from an env file, waits for Docker's health status, then
#    docker/smoke_check.py (in the project venv) checks auth, registers an MLP, computes a kernel over binary
#    and JSON, and compares it with compute_ntk run here on the downloaded weights.
# 5. Restarts the container and checks the model and its kernel are still there.
# 6. Where docker compose (or docker-compose) is installed: brings up docker/compose.yaml (service, Ray head,
#    Ray worker), checks that a Ray task started from the service container runs on the worker and writes to the
#    shared /data, and, when the build has /v1/jobs, runs a batch job on the cluster against compute_ntk.
#    NTK_SMOKE_COMPOSE=0 skips this. Prints timings and the image size.
#
# Env: NTK_DOCKER_CACHE (default /var/tmp/ntk-docker), NTK_SMOKE_PORT (18080), NTK_SMOKE_IMAGE
# (ntk-service:smoke), NTK_SMOKE_PYTHON (the project's .venv/bin/python), NTK_TORCH_WHEEL (default: found in
# $PIP_FIND_LINKS or /opt/wheels), NTK_SMOKE_KEEP=1 keeps the container, volume and engine for a look.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${NTK_DOCKER_CACHE:-/var/tmp/ntk-docker}"
port="${NTK_SMOKE_PORT:-18080}"
image="${NTK_SMOKE_IMAGE:-ntk-service:smoke}"
python="${NTK_SMOKE_PYTHON:-$repo/.venv/bin/python}"
base_image="${NTK_SMOKE_BASE_IMAGE:-ntk-base:bookworm-py311}"
container="ntk-smoke"
volume="ntk-smoke-data"
url="http://127.0.0.1:$port"
work="$(mktemp -d)"
dockerd_pid=""
linked_wheel=""
compose=()

t0=$(date +%s.%N)
declare -a timings=()
log() { printf '[smoke %6.1fs] %s\n' "$(awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN{print a-b}')" "$*"; }
step_start() { step_t0=$(date +%s.%N); log "$1"; }
step_end() { timings+=("$(printf '%-34s %7.1f s' "$1" "$(awk -v a="$(date +%s.%N)" -v b="$step_t0" 'BEGIN{print a-b}')")"); }

cleanup() {
    local rc=$?
    set +e
    if [[ $rc -ne 0 ]] && docker inspect "$container" >/dev/null 2>&1; then
        log "container logs (last 40 lines):"
        docker logs --tail 40 "$container" 2>&1 | sed 's/^/    /'
    fi
    if [[ $rc -ne 0 && -n "${compose[*]:-}" ]]; then
        log "compose logs (last 15 lines each):"
        "${compose[@]}" logs --tail 15 2>&1 | sed 's/^/    /'
    fi
    if [[ "${NTK_SMOKE_KEEP:-0}" != 1 ]]; then
        [[ -n "${compose[*]:-}" ]] && "${compose[@]}" down -v >/dev/null 2>&1
        docker rm -f "$container" >/dev/null 2>&1
        docker volume rm "$volume" >/dev/null 2>&1
        if [[ -n "$dockerd_pid" ]]; then
            log "stopping dockerd (pid $dockerd_pid)"
            kill "$dockerd_pid" 2>/dev/null
            for _ in $(seq 1 30); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 1; done
            # dockerd leaves its default network namespace mounted under the exec root.
            umount "$engine/exec/netns/default" 2>/dev/null
        fi
    fi
    [[ -n "$linked_wheel" ]] && rm -f "$linked_wheel"
    rm -rf "$work"
    if [[ $rc -eq 0 ]]; then log "PASS"; else log "FAIL (exit $rc)"; fi
    exit $rc
}
trap cleanup EXIT

need() { command -v "$1" >/dev/null 2>&1; }

# ---- 1. engine ----
step_start "Docker engine"
if ! { [[ -n "${DOCKER_HOST:-}" ]] && docker info >/dev/null 2>&1; }; then
    if ! need dockerd || ! need debootstrap; then
        log "installing docker.io and debootstrap from Debian"
        apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io debootstrap >/dev/null
    fi
    engine="$cache/engine"
    mkdir -p "$engine"
    export DOCKER_HOST="unix://$engine/docker.sock"
    if docker info >/dev/null 2>&1; then
        log "reusing the dockerd already listening on $DOCKER_HOST (left running)"
    else
        # --bridge=none/--iptables=false: no host network changes; containers use --network host.
        dockerd --host "$DOCKER_HOST" --data-root "$engine/root" --exec-root "$engine/exec" \
            --pidfile "$engine/dockerd.pid" --iptables=false --bridge=none >"$engine/dockerd.log" 2>&1 &
        dockerd_pid=$!
        for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
        docker info >/dev/null 2>&1 || { tail -n 20 "$engine/dockerd.log"; exit 1; }
        log "started dockerd pid $dockerd_pid on $DOCKER_HOST"
    fi
fi
log "engine $(docker version --format '{{.Server.Version}}')"
step_end "engine ready"

# ---- 2. base image ----
step_start "base image $base_image"
if [[ "$base_image" == ntk-base:* ]]; then
    "$repo/docker/make-base-image.sh" "$base_image"
fi
step_end "base image"

# ---- 3. build ----
wheel="${NTK_TORCH_WHEEL:-}"
if [[ -z "$wheel" ]]; then
    for dir in ${PIP_FIND_LINKS:-} /opt/wheels; do
        found="$(ls "$dir"/torch-2.13.0*-cp311-cp311-*linux*_x86_64.whl 2>/dev/null | head -n 1 || true)"
        if [[ -n "$found" ]]; then wheel="$found"; break; fi
    done
fi
build_args=(--build-arg "BASE_IMAGE=$base_image")
if [[ -n "$wheel" ]]; then
    linked_wheel="$repo/docker/wheels/$(basename "$wheel")"
    ln -f "$wheel" "$linked_wheel" 2>/dev/null || cp "$wheel" "$linked_wheel"
    # The local CPU wheel instead of the PyTorch index (which may be unreachable): an offline torch.
    build_args+=(--build-arg "WHEELS_DIR=docker/wheels" --build-arg "TORCH_INDEX_URL=")
    log "torch from the local wheel $wheel"
fi
step_start "docker build -t $image"
DOCKER_BUILDKIT=0 docker build --network host "${build_args[@]}" -t "$image" "$repo" >"$work/build.log" 2>&1 \
    || { tail -n 40 "$work/build.log"; exit 1; }
# One line per step, marked when the layer came from the cache.
awk '/^Step [0-9]+\/[0-9]+ :/ { if (s) print s; s = "    " substr($0, 1, 100); next }
     /Using cache/ { s = s "  [cached]" } END { if (s) print s }' "$work/build.log"
step_end "image build"
size_bytes="$(docker image inspect --format '{{.Size}}' "$image")"
size="$(awk -v b="$size_bytes" 'BEGIN{printf "%.2f GB", b / 1e9}')"
log "image $image: $size ($size_bytes bytes)"

# ---- 4. run ----
read_key="smoke-read-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
write_key="smoke-write-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
env_file="$work/ntk.env"
umask 077
printf 'NTK_API_KEYS=%s:read,%s:write\nNTK_HOST=127.0.0.1\nNTK_PORT=%s\n' "$read_key" "$write_key" "$port" >"$env_file"
docker rm -f "$container" >/dev/null 2>&1 || true
docker volume rm "$volume" >/dev/null 2>&1 || true
docker volume create "$volume" >/dev/null

wait_healthy() {
    local target="${1:-$container}" start status
    start=$(date +%s.%N)
    for _ in $(seq 1 180); do
        status="$(docker inspect --format '{{.State.Health.Status}}' "$target" 2>/dev/null || echo gone)"
        [[ "$status" == healthy ]] && break
        [[ "$(docker inspect --format '{{.State.Running}}' "$target")" == true ]] || { log "container exited"; exit 1; }
        sleep 1
    done
    [[ "$status" == healthy ]] || { log "not healthy after 180 s (status $status)"; exit 1; }
    log "container healthy after $(awk -v a="$(date +%s.%N)" -v b="$start" 'BEGIN{printf "%.1f", a - b}') s"
}

step_start "docker run (volume $volume, keys from an env file, port $port on loopback)"
# --network host: this engine runs without a bridge; NTK_HOST=127.0.0.1 keeps it off other interfaces.
docker run -d --name "$container" --network host --env-file "$env_file" -v "$volume:/data" "$image" >/dev/null
wait_healthy
log "runs as uid:gid $(docker exec "$container" id -u):$(docker exec "$container" id -g), NTK_DATA_DIR=$(docker exec "$container" printenv NTK_DATA_DIR)"
step_end "start until healthy"

step_start "register a model, compute a kernel, compare with the engine"
NTK_SMOKE_READ_KEY="$read_key" NTK_SMOKE_WRITE_KEY="$write_key" \
    "$python" "$repo/docker/smoke_check.py" register "$url" "$work/state.json"
step_end "register + kernel + check"

# ---- 5. restart ----
step_start "docker restart"
docker restart "$container" >/dev/null
wait_healthy
step_end "restart until healthy"
step_start "the model survived the restart"
NTK_SMOKE_READ_KEY="$read_key" "$python" "$repo/docker/smoke_check.py" after-restart "$url" "$work/state.json"
docker exec "$container" sh -c 'ls -la /data' | sed 's/^/    /'
step_end "check after restart"

# ---- 6. compose: the service with a Ray head and a Ray worker, from the same image ----
if docker compose version >/dev/null 2>&1; then compose_cmd=(docker compose)
elif need docker-compose; then compose_cmd=(docker-compose)
else compose_cmd=()
fi
if [[ "${NTK_SMOKE_COMPOSE:-1}" != 1 || ${#compose_cmd[@]} -eq 0 ]]; then
    log "compose phase skipped (NTK_SMOKE_COMPOSE=0, or no docker compose / docker-compose)"
else
    step_start "compose up: ntk + ray-head + ray-worker (${compose_cmd[*]})"
    compose_port=$((port + 1))
    printf 'NTK_API_KEYS=%s:read,%s:write\n' "$read_key" "$write_key" >"$work/compose.env"
    export NTK_IMAGE="$image" NTK_ENV_FILE="$work/compose.env" NTK_PUBLISH="127.0.0.1:$compose_port" \
        NTK_DATA_VOLUME="ntk-smoke-compose-data" NTK_RAY_SHM_SIZE=512mb NTK_RAY_OBJECT_STORE_BYTES=300000000 \
        NTK_RAY_WORKER_CPUS=1
    compose=("${compose_cmd[@]}" -p ntksmoke -f "$repo/docker/compose.yaml")
    "${compose[@]}" up -d --no-build 2>&1 | sed 's/^/    /'
    ntk_id="$("${compose[@]}" ps -q ntk)"
    wait_healthy "$ntk_id"
    step_end "compose up until healthy"

    step_start "compose: a Ray task from the service container runs on the worker and writes to /data"
    docker exec "$ntk_id" python -c '
import socket, ray
ray.init(address="ray-head:6379", logging_level="ERROR")
alive = [n for n in ray.nodes() if n["Alive"]]
@ray.remote(num_cpus=1)
def probe(path):
    with open(path, "w") as f:
        f.write(socket.gethostname())
    return socket.gethostname()
host = ray.get(probe.remote("/data/.smoke-probe"))
seen = open("/data/.smoke-probe").read()
print(f"    {len(alive)} Ray nodes alive; task ran on {host}, service is {socket.gethostname()}, /data shows {seen}")
assert len(alive) == 3 and host != socket.gethostname() and seen == host
'
    python_url="http://127.0.0.1:$compose_port"
    "$python" -c "import urllib.request as u; print('    published port:', u.urlopen('$python_url/healthz', timeout=5).read().decode())"
    step_end "compose: Ray task + shared volume"
    if "$python" -c "import json, urllib.request as u, sys; sys.exit('/v1/jobs' not in json.load(u.urlopen('$python_url/openapi.json', timeout=5))['paths'])"; then
        step_start "compose: a batch job on the Ray cluster, checked against compute_ntk"
        NTK_SMOKE_READ_KEY="$read_key" NTK_SMOKE_WRITE_KEY="$write_key" \
            "$python" "$repo/docker/smoke_check.py" ray-job "$python_url" "$work/job.json"
        step_end "compose: ray job"
    else
        log "this build has no /v1/jobs yet: batch job on the cluster not checked"
    fi
fi

log "timings:"
printf '    %s\n' "${timings[@]}"
log "image size: $size"
