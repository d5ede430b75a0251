# The two set-up commands (README "Quickstart"): `make serve` and `make test`.
# Each creates .venv if missing and installs through constraints.txt (torch pinned to the CPU build).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: serve test lint docs format bench peer-venv test-cpus trak-venv kronfluence-venv

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[server,dev,ray]'
	touch $(STAMP)

# OpenMP threads sleep instead of spinning while they wait: on a shared host spinning made kernels up to 10x
# slower (benchmarks/bench_structured.py, NOTE [OpenMP wait policy]); on an idle one it is within noise.
# numpy's BLAS threads are capped by the server itself (NOTE [threads] in server/compute.py). Ctrl-C (or SIGTERM)
# shuts the server down gracefully and it exits 0, so make reports no error (NOTE [exit status] in cli/_serve.py).
serve: $(STAMP)
	OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(VENV)/bin/ntk-service serve

# mypy: strict, on the package (pyproject.toml [tool.mypy]); tests are checked by the suite, not by mypy.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/hadolint Dockerfile

# The documentation site (docs/ + the API reference from the docstrings) into site/; --strict (mkdocs.yml) fails
# on any warning: a broken link or anchor, a cross-reference to nothing, a docstring griffe cannot parse.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --quiet

# The suite in TEST_WORKERS processes (pytest-xdist), a whole test file per worker at a time (--dist loadfile), so
# a module's server, Ray instance or browser still starts once. Most of the slow tests wait on a subprocess (a server
# importing torch, Ray, Chromium, a slow model's sleeps), so two workers keep both cores busy on a 2-core machine.
# Every test is isolated (its own port, tmp_path, data directory and Ray session). The longest files go first
# (HEAVY_FIRST in tests/conftest.py; xdist's own reorder would put them last). `TEST_WORKERS=0` runs serially.
TEST_WORKERS ?= 2

test: lint docs
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The numerical tests again under the BLAS and vector kernels other x86-64 CPUs take (OpenBLAS's core type, MKL's
# code path, ATen's instruction set): a tolerance that holds only on this machine's rounding fails here instead of
# on CI's next host (a block-CG test at rtol 1e-11 passed on one 2-core host and failed 3 of 3 on another).
CPU_VARIANTS := "OPENBLAS_CORETYPE=Haswell ATEN_CPU_CAPABILITY=avx2" \
	"OPENBLAS_CORETYPE=Sandybridge MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default" \
	"OPENBLAS_CORETYPE=Prescott ATEN_CPU_CAPABILITY=default"
CPU_TESTS ?= tests/analysis tests/kernels

test-cpus: $(STAMP)
	@for variant in $(CPU_VARIANTS); do \
		echo "== $$variant"; \
		env $$variant OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -p no:cacheprovider $(CPU_TESTS) || exit 1; \
	done

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(STAMP)
	$(PY) benchmarks/bench_kernels.py

# The neural-tangents peer for benchmarks/ (issue 3), in its own venv: it needs jax 0.4.25 (newer jax breaks
# NT 0.6.5's structured derivatives) and numpy<2, which must not touch $(VENV). No torch there: the peer
# script is pure JAX. `--no-deps` skips NT's declared tensorflow/tf2jax (only its optional TF bridge uses
# them; benchmarks/peer_neural_tangents.py stubs that module out, see NOTE there); frozendict is its one
# other import. The transitive pins are the versions the benchmark was measured with.
PEER_VENV := .peer-venv
PEER_STAMP := $(PEER_VENV)/.installed-stamp

$(PEER_STAMP):
	test -x $(PEER_VENV)/bin/python || python3 -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEER_VENV)/bin/python -m pip install -q jax==0.4.25 jaxlib==0.4.25 "numpy<2" ml_dtypes==0.5.4 \
		scipy==1.17.1 opt_einsum==3.4.0 frozendict==2.5.1
	$(PEER_VENV)/bin/python -m pip install -q --no-deps neural-tangents==0.6.5
	$(PEER_VENV)/bin/python benchmarks/peer_neural_tangents.py --models mlp --sizes 2 \
		--implementations structured_derivatives --repeats 1 > /dev/null
	touch $(PEER_STAMP)

peer-venv: $(PEER_STAMP)

# The attribution peers of benchmarks/bench_attribution.py (issue 39), each in its own venv with the project's torch
# (pinned through constraints.txt): traker 0.3.2 (its CPU BasicProjector) and kronfluence 1.0.1 (EK-FAC).
# scikit-learn is for the digits data both load. kronfluence pulls torchvision, whose only wheel here fails at
# import (`operator torchvision::nms does not exist`, DESIGN.md); kronfluence never imports it, so it is removed
# rather than left broken in the venv.
TRAK_VENV := .trak-venv
KFAC_VENV := .kfac-venv

$(TRAK_VENV)/.installed-stamp:
	test -x $(TRAK_VENV)/bin/python || python3 -m venv $(TRAK_VENV)
	$(TRAK_VENV)/bin/python -m pip install -q -c constraints.txt torch==2.13.0 traker==0.3.2 scikit-learn
	$(TRAK_VENV)/bin/python -c "import trak, sklearn"
	touch $@

$(KFAC_VENV)/.installed-stamp:
	test -x $(KFAC_VENV)/bin/python || python3 -m venv $(KFAC_VENV)
	$(KFAC_VENV)/bin/python -m pip install -q -c constraints.txt torch==2.13.0 kronfluence==1.0.1 scikit-learn
	$(KFAC_VENV)/bin/python -m pip uninstall -q -y torchvision
	$(KFAC_VENV)/bin/python -c "import kronfluence.analyzer, sklearn"
	touch $@

trak-venv: $(TRAK_VENV)/.installed-stamp
kronfluence-venv: $(KFAC_VENV)/.installed-stamp
