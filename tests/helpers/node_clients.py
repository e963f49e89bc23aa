"""The Node SDKs (`openai`, `@anthropic-ai/sdk`) and `undici`, and a Node recent enough to
proxy `fetch` itself (NODE_USE_ENV_PROXY), installed with the real npm from the public
registry once per machine (setup, not test traffic) and cached outside the repo, like
hadolint and helm. Without npm or the registry the tests that need them FAIL: CI must run
them."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from helpers.cache_lock import installing

PACKAGES = ("openai@6", "@anthropic-ai/sdk@1", "undici@7")
# The newest 24.x (LTS) on npm, where the Node project's release binaries are published as
# node-linux-<arch>. Its fetch honours NODE_USE_ENV_PROXY (24.0+ and 22.21+; 22.20 and
# older lack it, as does Debian's Node 20).
NODE_VERSION = "24.21.0"
NODE_ARCHES = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sandbox-gateway"


def _npm_install(root: Path, packages: tuple[str, ...]) -> Path:
    """`root`, whose node_modules hold `packages` (installed once: `.installed` marks it)."""
    assert shutil.which("node") and shutil.which("npm"), (
        "node and npm are needed (scripts/test-tools.sh installs nodejs and npm)")
    with installing(root):
        if (root / ".installed").is_file():
            return root
        work = root.with_name(root.name + ".tmp")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        (work / "package.json").write_text('{"name": "node-clients", "private": true}\n')
        proc = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--ignore-scripts",
                               "--loglevel=error", *packages], cwd=work, capture_output=True,
                              text=True, timeout=300, check=False)
        assert proc.returncode == 0, f"npm install {' '.join(packages)} failed:\n{proc.stderr}"
        (work / ".installed").touch()
        shutil.rmtree(root, ignore_errors=True)
        work.rename(root)
        return root


def node_clients() -> Path:
    """A directory whose node_modules hold PACKAGES (scripts placed in it import them)."""
    key = hashlib.sha256(" ".join(PACKAGES).encode()).hexdigest()[:12]
    return _npm_install(cache_root() / f"node-clients-{key}", PACKAGES)


def env_proxy_node() -> Path:
    """The `node` binary of Node NODE_VERSION (its `fetch` honours NODE_USE_ENV_PROXY, no
    preload needed), from the npm package node-linux-<arch>."""
    arch = NODE_ARCHES.get(platform.machine().lower())
    assert platform.system() == "Linux" and arch, (
        f"no node-linux-* package on npm for {platform.system()} {platform.machine()}")
    package = f"node-linux-{arch}"
    root = _npm_install(cache_root() / f"node-{NODE_VERSION}-{arch}",
                        (f"{package}@{NODE_VERSION}",))
    node = root / "node_modules" / package / "bin" / "node"
    version = subprocess.run([str(node), "--version"], capture_output=True, text=True,
                             timeout=30, check=False)
    assert version.stdout.strip() == f"v{NODE_VERSION}", (
        f"{node} does not run: {version.stdout}{version.stderr}")
    return node


# Agent CLIs from npm, pinned: the versions whose traffic the shipped presets were written
# from (gateway/services/policy/agents). Codex and Claude Code are native binaries in
# per-platform packages (so is opencode); the Gemini CLI is JavaScript (Node 20+).
AGENT_PACKAGES = ("@openai/codex@0.169.0", "@anthropic-ai/claude-code@2.1.332",
                  "@google/gemini-cli@0.61.0", "opencode-ai@1.18.33")


def agent_clis() -> dict[str, Path]:
    """`codex`, `claude`, `gemini` and `opencode` (installed once per machine, cached like
    the SDKs)."""
    key = hashlib.sha256(" ".join(AGENT_PACKAGES).encode()).hexdigest()[:12]
    root = _npm_install(cache_root() / f"agent-clis-{key}", AGENT_PACKAGES)
    claude = root / "node_modules" / "@anthropic-ai" / "claude-code"
    if (claude / "bin" / "claude.exe").stat().st_size < 1 << 20:
        # The package's own postinstall (skipped by --ignore-scripts, no network): it puts
        # the platform package's native binary over the bin/claude.exe placeholder.
        proc = subprocess.run(["node", "install.cjs"], cwd=claude, capture_output=True,
                              text=True, timeout=120, check=False)
        assert proc.returncode == 0, f"claude-code install.cjs failed:\n{proc.stderr}"
    opencode = root / "node_modules" / "opencode-ai"
    if (opencode / "bin" / "opencode.exe").stat().st_size < 1 << 20:
        # Its postinstall (also skipped, no network) links the platform package's binary.
        proc = subprocess.run(["node", "postinstall.mjs"], cwd=opencode, capture_output=True,
                              text=True, timeout=120, check=False)
        assert proc.returncode == 0, f"opencode postinstall.mjs failed:\n{proc.stderr}"
    tools = {name: root / "node_modules" / ".bin" / name
             for name in ("codex", "claude", "gemini", "opencode")}
    # Each one runs (all four at once: Node's start, mostly reading its modules, took
    # 10-20 s one after the other on a loaded machine).
    running = {name: subprocess.Popen([str(path), "--version"], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
               for name, path in tools.items()}
    try:
        for name, proc in running.items():
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, f"{name} does not run: {out}{err}"
    finally:
        for proc in running.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return tools


# JavaScript runtimes besides Node, pinned: their release binaries in npm's per-platform
# packages (Bun reads HTTPS_PROXY and NODE_EXTRA_CA_CERTS, Deno HTTPS_PROXY and DENO_CERT).
RUNTIME_PACKAGES = ("bun@1.4.5", "deno@2.9.6")
RUNTIME_BINARIES = {"bun": ("@oven", "bun-linux-{arch}", "bin/bun"),
                    "deno": ("@deno", "{arch}-glibc", "deno")}
RUNTIME_ARCHES = {"bun": {"x86_64": "x64", "aarch64": "aarch64"},
                  "deno": {"x86_64": "linux-x64", "aarch64": "linux-arm64"}}


def js_runtimes() -> dict[str, Path]:
    """`bun` and `deno` (installed once per machine)."""
    key = hashlib.sha256(" ".join(RUNTIME_PACKAGES).encode()).hexdigest()[:12]
    root = _npm_install(cache_root() / f"js-runtimes-{key}", RUNTIME_PACKAGES)
    machine = platform.machine().lower()
    tools: dict[str, Path] = {}
    for name, (scope, package, binary) in RUNTIME_BINARIES.items():
        arch = RUNTIME_ARCHES[name].get(machine)
        assert platform.system() == "Linux" and arch, f"no {name} package for {machine}"
        tools[name] = root / "node_modules" / scope / package.format(arch=arch) / binary
        assert tools[name].is_file(), tools[name]
    return tools


AXE_VERSION = "4.11.0"


def axe_core() -> Path:
    """`axe.min.js` of axe-core (Deque's accessibility engine, pinned), from npm once per
    machine: the console's pages are checked with it in the real browser."""
    root = _npm_install(cache_root() / f"axe-core-{AXE_VERSION}", (f"axe-core@{AXE_VERSION}",))
    return root / "node_modules" / "axe-core" / "axe.min.js"
