"""The Node SDKs (`openai`, `@anthropic-ai/sdk`) and `undici`, installed with the real npm
from the public registry once per machine (setup, not test traffic) and cached outside
the repo, like hadolint and helm. Without npm or the registry the tests that need them
FAIL: CI must run them."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

PACKAGES = ("openai@6", "@anthropic-ai/sdk@1", "undici@7")


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sandbox-gateway"


def node_clients() -> Path:
    """A directory whose node_modules hold PACKAGES (scripts placed in it import them)."""
    assert shutil.which("node") and shutil.which("npm"), (
        "node and npm are needed (scripts/test-tools.sh installs nodejs and npm)")
    key = hashlib.sha256(" ".join(PACKAGES).encode()).hexdigest()[:12]
    root = _cache_root() / f"node-clients-{key}"
    if (root / ".installed").is_file():
        return root
    work = root.with_name(root.name + ".tmp")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "package.json").write_text('{"name": "node-clients", "private": true}\n')
    proc = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--ignore-scripts",
                           "--loglevel=error", *PACKAGES], cwd=work, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"npm install {' '.join(PACKAGES)} failed:\n{proc.stderr}"
    (work / ".installed").touch()
    shutil.rmtree(root, ignore_errors=True)
    work.rename(root)
    return root
