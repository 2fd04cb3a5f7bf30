# Everything kvdir needs is installed by these targets; nothing by hand.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
ARGS   ?=

.PHONY: install run lint test test-compose bench clean sysdeps

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

run: install
	$(VENV)/bin/kvdir up --demo $(ARGS)

# Lint, format, the import direction (README, "Architecture") and types: part of `make test`.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest $(ARGS)

# The docker-compose cluster, built, run and broken (tests/compose/run.sh: installs Docker from Debian's
# packages and starts a daemon when needed, and stops what it started).
test-compose: install
	bash tests/compose/run.sh $(ARGS)

bench: install
	$(VENV)/bin/kvdir bench directory $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache .import_linter_cache
