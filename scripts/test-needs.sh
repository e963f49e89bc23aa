#!/usr/bin/env bash
# What `make test` needs and cannot install itself, checked before anything runs.
#   - root: the network-namespace tests (pytest -m netns) create namespaces, veth pairs
#     and iptables rules; CI runs as root.
#   - network access for setup: PyPI (the locked Python packages, helm and hadolint
#     wheels), Debian (scripts/test-tools.sh: curl, redis, nginx, squid, chromium and
#     chromium-driver, ...), npm (the client matrix's Node packages).
#     Those steps say so themselves when they fail.
# SANDBOX_GATEWAY_TEST_NO_ROOT=1 skips the root check (the netns tests then fail).
set -euo pipefail
if [ "$(id -u)" != 0 ] && [ "${SANDBOX_GATEWAY_TEST_NO_ROOT:-}" != 1 ]; then
  cat >&2 <<'MSG'
make test: needs root. The network-namespace tests (pytest -m netns:
  tests/integration/test_transparent.py, test_parity_transparent.py and the namespace
  tests in test_dns.py) create network namespaces and iptables rules, and
  scripts/test-tools.sh installs system packages with apt-get. CI runs as root.
Run it as root, or without those tests: make lint typecheck && .venv/bin/pytest -m 'not netns'
MSG
  exit 1
fi
