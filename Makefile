# sandbox-gateway: `make run` starts the gateway on its embedded defaults,
# `make test` runs the whole suite (lint, types, tests). Both set themselves up.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# First Python >= 3.12 found (pyenv shims refuse unselected versions: the check skips them).
PYTHON ?= $(shell for p in python3.13 python3.12 python3; do \
	  command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null \
	  && { echo $$p; break; }; done)

.PHONY: run demo test lint typecheck unit tools bench soak clean

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "need Python 3.12 or newer (python3.12 / python3.13)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

run: $(STAMP)
	$(VENV)/bin/sandbox-gateway run $(if $(CONFIG),--config $(CONFIG))

# The gateway, a stand-in OpenAI and an agent configured only by `sandbox-gateway env`,
# on 127.0.0.1 in a few seconds: the key swap and a refusal, end to end (no Docker).
demo: $(STAMP)
	$(PY) examples/demo/demo.py

tools:
	@bash scripts/test-tools.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check gateway tests bench examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(VENV)/bin/pytest -q

test: $(STAMP) tools lint typecheck unit

bench: $(STAMP) tools
	$(PY) -m bench $(ARGS)

# Soak: the mixed-load test for SOAK_SECONDS (default 600) with its figures printed.
soak: $(STAMP) tools
	SOAK_SECONDS=$${SOAK_SECONDS:-600} $(VENV)/bin/pytest -q -s tests/reliability/test_soak.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
