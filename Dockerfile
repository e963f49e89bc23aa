# syntax=docker/dockerfile:1
# sandbox-gateway image.
#   docker build -t sandbox-gateway .
#   docker run --read-only --tmpfs /tmp -v sandbox-gateway-state:/var/lib/sandbox-gateway \
#     -p 8080:8080 -p 127.0.0.1:8090:8090 -v "$PWD/policies:/etc/sandbox-gateway/policies:ro" sandbox-gateway
# The named volume keeps certs/ (CA, signing keys, admin token) across restarts and upgrades: without
# it every new container makes a new CA (sandboxes would stop trusting the gateway) and new keys.
# In Kubernetes use charts/sandbox-gateway (it mounts gateway.yaml, policies, certs and the scratch dirs).
# Release builds should pin the base image by digest as well: python:3.12-slim-bookworm@sha256:<digest>.

# ---------------------------------------------------------------------------- builder
FROM python:3.12-slim-bookworm AS builder

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src
# Dependencies from the lock file only: exact versions, every file checked against its sha256
# (requirements.lock: runtime dependencies + setuptools, the build backend; see CONTRIBUTING.md).
COPY requirements.lock ./
RUN pip install --no-cache-dir --require-hashes -r requirements.lock
# README.md is optional for the build (the glob keeps COPY from failing without it).
COPY pyproject.toml setup.py README.m[d] ./
COPY gateway ./gateway
# A C compiler for the three compiled pieces: the passthrough relay's thread
# (gateway/engines/_relay.c; without it the gateway relays on its event loop, ~1.4x the
# CPU a small request), the body scans' gate pass (gateway/core/dlp/_gate.c, x86-64;
# without it Hyperscan makes the pass, about twice the CPU) and the reading of a JSON
# body's strings (gateway/core/dlp/_jsontext.c; without it json.loads, ~6x). Builder
# stage only: the runtime copies the built venv.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# The package itself, with nothing fetched: no dependency resolution, no build isolation.
# pip compiles the .pyc files here, so the read-only runtime never needs to write them;
# the imports check they were built (the gate on x86-64 only).
RUN pip install --no-cache-dir --no-deps --no-build-isolation . \
    && sandbox-gateway --help >/dev/null \
    && python -c "import gateway.engines._relay, gateway.core.dlp._jsontext" \
    && { [ "$(uname -m)" != x86_64 ] || python -c "import gateway.core.dlp._gate"; }

# ---------------------------------------------------------------------------- runtime
FROM python:3.12-slim-bookworm

LABEL org.opencontainers.image.title="sandbox-gateway" \
      org.opencontainers.image.description="Secrets-and-egress gateway for AI agent sandboxes" \
      org.opencontainers.image.licenses="Apache-2.0"

# Numeric, non-root identity (Kubernetes runAsNonRoot can verify a numeric USER).
# /etc/sandbox-gateway is read-only configuration (the chart mounts gateway.yaml, policies/ and certs/
# over it); the only writable paths are /tmp (scratch: runtime_dir, a tmpfs) and /var/lib/sandbox-gateway
# (state that must persist: certs/ and state/gateway.db, a volume).
# jemalloc: `sandbox-gateway run` starts itself on it where it is installed (PYTHONMALLOC=malloc,
# LD_PRELOAD; gateway/runtime/allocator.py), so a worker gives a burst's memory back (1.1-1.2x its
# idle RSS after 5,000 closed tunnels, 1.7x on CPython's own allocator) at the same CPU per request.
# `-e PYTHONMALLOC=pymalloc` keeps CPython's. Not version-pinned: Debian stable only ships
# security fixes, and a pinned version stops building once it is superseded.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libjemalloc2 \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 sandbox-gateway \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin sandbox-gateway \
    && mkdir -p /etc/sandbox-gateway/policies /etc/sandbox-gateway/certs /var/lib/sandbox-gateway \
    && chown 10001:10001 /var/lib/sandbox-gateway \
    && chmod 0750 /var/lib/sandbox-gateway \
    && printf '%s\n' \
       '# Default for a standalone container; the Helm chart mounts its own gateway.yaml here.' \
       'listen: {proxy: "0.0.0.0:8080", admin: "0.0.0.0:8090"}' \
       'policies: /etc/sandbox-gateway/policies' \
       'certs: /var/lib/sandbox-gateway/certs' \
       'state: {store: sqlite, path: /var/lib/sandbox-gateway/state/gateway.db}' \
       'runtime_dir: /tmp/sandbox-gateway' \
       'secrets: {store: env}' \
       > /etc/sandbox-gateway/gateway.yaml

COPY --from=builder /opt/venv /opt/venv

# MALLOC_ARENA_MAX: where glibc's malloc is the allocator (PYTHONMALLOC set to keep it), its arenas
# for the resolver's and executor's threads are not multiplied by the node's cores (memory a worker
# gives back after a burst: docs/operations.md "Memory after a burst, and the memory ceiling").
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TMPDIR=/tmp \
    MALLOC_ARENA_MAX=2

WORKDIR /var/lib/sandbox-gateway
# CA, signing keys and admin token: generated at the first start, kept by the volume.
VOLUME ["/var/lib/sandbox-gateway"]
USER 10001:10001

# proxy, admin (/healthz, /readyz, /metrics, admin API); the optional transparent listener is 8081.
EXPOSE 8080 8090

# No curl in slim: ask the admin listener with the venv's python.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8090/healthz', timeout=3).status == 200 else 1)"]

ENTRYPOINT ["sandbox-gateway"]
CMD ["run", "--config", "/etc/sandbox-gateway/gateway.yaml"]
