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

.PHONY: run demo test needs lint typecheck unit tools bench soak lock diagram clean jvm-agent catalogue config-schema

# Dependencies come only from the hashed lock files (exact versions, sha256 of every file):
# requirements-dev.lock (runtime + dev + setuptools) here, requirements.lock (runtime +
# setuptools) in the Dockerfile. `make lock` updates them; see CONTRIBUTING.md.
$(STAMP): pyproject.toml requirements-dev.lock setup.py $(wildcard gateway/*/*.c gateway/*/*/*.c)
	@test -n "$(PYTHON)" || { echo "need Python 3.12 or newer (python3.12 / python3.13)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --require-hashes -r requirements-dev.lock || { echo >&2; \
	  echo "make: installing the locked Python packages failed: setup needs network access to PyPI" >&2; \
	  echo "      (or an index in PIP_INDEX_URL that serves the same files: hashes are checked)" >&2; exit 1; }
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $@

UV_VERSION := 0.13.9
LOCK_FLAGS := --generate-hashes --universal --python-version 3.12 --quiet \
	--custom-compile-command "make lock"

# Re-resolve the lock files from pyproject.toml (existing pins are kept where they still fit;
# `make lock ARGS=--upgrade` or `ARGS="--upgrade-package ruff"` moves them on).
lock:
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(PYTHON) -m venv "$$tmp" && "$$tmp/bin/pip" install -q "uv==$(UV_VERSION)" && \
	printf 'setuptools>=69\n' | "$$tmp/bin/uv" pip compile pyproject.toml - --extra dev \
	  $(LOCK_FLAGS) $(ARGS) -o requirements-dev.lock && \
	printf 'setuptools>=69\n' | "$$tmp/bin/uv" pip compile pyproject.toml - \
	  $(LOCK_FLAGS) -c requirements-dev.lock -o requirements.lock

# What is generated from the configuration's schema (gateway/config.py): docs/configuration.md's
# table of keys and the chart's values.schema.json gateway keys (tests/test_config_schema.py).
config-schema: $(STAMP)
	$(PY) scripts/config-schema.py

# The model catalogue (context windows, output limits, prices) that bounds reservations:
# LiteLLM's published data file, trimmed (scripts/update-catalogue.py). `make catalogue`
# takes the newest LiteLLM on PyPI; CATALOGUE_VERSION=1.110.2 pins one.
catalogue: $(STAMP)
	$(PY) scripts/update-catalogue.py $(if $(CATALOGUE_VERSION),--version $(CATALOGUE_VERSION))

# `make run` serves this host only: the proxy on 127.0.0.1:8080 (the README's quick start).
# LISTEN=0.0.0.0:8080 serves other hosts too (containers on this host, other machines: then
# say what limits them in listen.reachable_from); with a config (CONFIG=, or
# SANDBOX_GATEWAY_CONFIG) its listen.proxy decides.
LISTEN ?= 127.0.0.1:8080
run: $(STAMP)
	$(if $(CONFIG)$(SANDBOX_GATEWAY_CONFIG),,SANDBOX_GATEWAY_LISTEN__PROXY=$(LISTEN) )$(VENV)/bin/sandbox-gateway run $(if $(CONFIG),--config $(CONFIG))

# The gateway, a stand-in OpenAI and an agent configured only by `sandbox-gateway env`,
# on 127.0.0.1 in a few seconds: the key swap and a refusal, end to end (no Docker).
demo: $(STAMP)
	$(PY) examples/demo/demo.py

tools:
	@bash scripts/test-tools.sh

# What `make test` needs that it cannot install itself (root), said before anything runs.
needs:
	@bash scripts/test-needs.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check gateway tests bench examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The suite in one process more than the cores, at most 4 (pytest-xdist): its tests wait on
# processes, sockets and timers about half the time (490 s of CPU in 500 s of `-n 2` on 2
# cores), and a third process fills that. Measured 2026-11-30 on 2 cores with others' work
# beside, five alternating pairs: pytest `-n 3` 485, 464, 402, 399 and 455 s, `-n 2` 549,
# 573, 511, 581 and 544 s (the failures seen: CHANGELOG, wave 4, Internal). Four processes
# on 2 cores were faster still but failed timing tests (an earlier session). How long `make test` takes is
# said in one place, README.md ("make test (about ..."). `make unit JOBS=0`: one process.
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); n=$$((n + 1)); [ "$$n" -gt 4 ] && n=4; echo $$n)

unit: $(STAMP)
	$(VENV)/bin/pytest -q -n $(JOBS)

test: needs $(STAMP) tools lint typecheck unit

# docs/deployment.svg is rendered from docs/deployment.dot (Debian graphviz; tests/test_docs.py).
# The JVM agent (gateway/sandbox/jvm/*.java) as the committed jar, byte for byte the same
# from the same javac (tests/tools/test_jvm_agent.py checks): Java 11 class files, a fixed
# timestamp, entries in a fixed order.
JVM_AGENT := gateway/sandbox/jvm-proxy-agent.jar
jvm-agent:
	rm -rf build/jvm-agent && mkdir -p build/jvm-agent/classes
	javac -Xlint:all -Werror --release 11 -d build/jvm-agent/classes gateway/sandbox/jvm/*.java
	printf 'Premain-Class: io.sandboxgateway.GatewayProxyAgent\n' > build/jvm-agent/manifest.txt
	jar --create --file $(JVM_AGENT) --date=2026-01-01T00:00:00Z \
	  --manifest build/jvm-agent/manifest.txt -C build/jvm-agent/classes .

diagram:
	dot -Tsvg docs/deployment.dot -o docs/deployment.svg

bench: $(STAMP) tools
	$(PY) -m bench $(ARGS)

# Soak: the mixed-load test for SOAK_SECONDS (default 600), the console fuzz with 1,000
# requests (400 in the suite), every variant of the budget's durability under kills (the
# suite runs 6 of 8), then the memory burst for
# MEMORY_ROUNDS rounds (default 3) of MEMORY_BURST tunnels (5000; the suite runs one),
# figures printed (on the default allocator, jemalloc where installed:
# docs/operations.md "Memory after a burst").
soak: $(STAMP) tools
	SOAK_SECONDS=$${SOAK_SECONDS:-600} MEMORY_ROUNDS=$${MEMORY_ROUNDS:-3} \
	  CONSOLE_FUZZ_REQUESTS=$${CONSOLE_FUZZ_REQUESTS:-1000} DURABILITY_VARIANTS=all \
	  $(VENV)/bin/pytest -q -s \
	  tests/reliability/test_soak.py tests/reliability/test_memory_burst.py \
	  tests/integration/test_console_fuzz.py tests/integration/test_budget_durability.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
