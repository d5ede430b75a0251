# ntk-service image: the HTTP service, and (same image) a Ray head or worker for batch jobs.
#
# Legacy-builder compatible (no BuildKit-only syntax). Build arguments:
#   BASE_IMAGE       a Python 3.11 image with venv + pip. Default: python:3.11-slim. docker/make-base-image.sh
#                    builds an equivalent one from Debian packages where no image registry is reachable.
#   TORCH_INDEX_URL  extra index torch comes from. Default: the CPU builds. For CUDA use e.g.
#                    https://download.pytorch.org/whl/cu128; empty: only PyPI and WHEELS_DIR.
#   WHEELS_DIR       directory inside the build context searched first (pip --find-links), e.g. a local
#                    torch wheel for an offline build. Default: docker/wheels (empty in git).
#   NO_INDEX         set to 1 to forbid any index: everything must then be in WHEELS_DIR.
# torch is always pinned through constraints.txt (torch==2.13.0, CPU or CUDA local variants both satisfy it).
# See docker/README.md.

ARG BASE_IMAGE=python:3.11-slim

# ---- stage 1: a virtual environment with every dependency, then the package ----
FROM ${BASE_IMAGE} AS builder

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG WHEELS_DIR=docker/wheels
ARG NO_INDEX=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_FIND_LINKS=/tmp/wheels \
    PATH=/opt/venv/bin:$PATH

SHELL ["/bin/sh", "-eu", "-c"]

RUN python3 -m venv /opt/venv

COPY constraints.txt /tmp/build/constraints.txt
COPY ${WHEELS_DIR}/ /tmp/wheels/

# torch first, alone: it is the big layer and changes only with constraints.txt or the variant.
RUN if [ -n "${TORCH_INDEX_URL}" ] && [ -z "${NO_INDEX}" ]; then set -- --extra-index-url "${TORCH_INDEX_URL}"; fi; \
    pip install --no-cache-dir ${NO_INDEX:+--no-index} -c /tmp/build/constraints.txt "$@" torch==2.13.0

# The other dependencies (the client's, the server extra, and the ray extra so the image is also a Ray node) and
# the build backend, read from pyproject.toml alone: the code is not copied yet, so editing code keeps this layer.
COPY pyproject.toml /tmp/build/pyproject.toml
RUN python3 -c "import tomllib; t = tomllib.load(open('/tmp/build/pyproject.toml', 'rb')); p = t['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['server'] + p['optional-dependencies']['ray'] \
+ t['build-system']['requires']))" \
        > /tmp/build/requirements.txt \
    && pip install --no-cache-dir ${NO_INDEX:+--no-index} -c /tmp/build/constraints.txt \
        -r /tmp/build/requirements.txt

# The package as a wheel, outside the venv: the runtime stage copies the venv (dependencies only, a big layer that
# stays cached) and installs this small wheel on top.
COPY pyproject.toml constraints.txt LICENSE README.md* /tmp/build/src/
COPY ntk_service /tmp/build/src/ntk_service
RUN pip wheel --no-cache-dir --no-deps --no-build-isolation -w /tmp/dist /tmp/build/src

# ---- stage 2: runtime: the venv and the package, no build inputs, non-root ----
FROM ${BASE_IMAGE} AS runtime

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    RAY_USAGE_STATS_ENABLED=0 \
    OMP_WAIT_POLICY=PASSIVE \
    NTK_HOST=0.0.0.0 \
    NTK_PORT=8000 \
    NTK_DATA_DIR=/data

RUN groupadd --gid 10001 ntk \
    && useradd --no-log-init --uid 10001 --gid ntk --home-dir /home/ntk --create-home --shell /usr/sbin/nologin ntk \
    && mkdir -p /data \
    && chown ntk:ntk /data

COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /tmp/dist /tmp/dist
RUN pip install --no-cache-dir --no-deps --no-index /tmp/dist/*.whl \
    && pip check \
    && rm -rf /tmp/dist

USER 10001:10001
WORKDIR /home/ntk
VOLUME ["/data"]
EXPOSE 8000

HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('NTK_PORT', '8000'), timeout=4)"]

CMD ["ntk-service", "serve"]
