"""Python agent CLIs from PyPI, pinned (the versions whose traffic the shipped presets were
written from), each in its own virtualenv cached outside the repo like the Node clients:
installed once per machine (setup, not test traffic). Without PyPI the tests that need
them FAIL: CI must run them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from helpers.node_clients import cache_root

AIDER = "aider-chat==0.86.2"


def aider_cli() -> Path:
    """The `aider` executable of AIDER."""
    root = cache_root() / f"aider-{AIDER.split('==')[1]}"
    aider = root / "bin" / "aider"
    if not (root / ".installed").is_file():
        shutil.rmtree(root, ignore_errors=True)  # a half-made one from an interrupted run
        subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=300)
        proc = subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "-q",
                               "--disable-pip-version-check", AIDER],
                              capture_output=True, text=True, timeout=900, check=False)
        assert proc.returncode == 0, f"pip install {AIDER} failed:\n{proc.stderr[-3000:]}"
        (root / ".installed").touch()
    version = subprocess.run([str(aider), "--version"], capture_output=True, text=True,
                             timeout=120, check=False)
    assert version.stdout.strip() == f"aider {AIDER.split('==')[1]}", version
    return aider
