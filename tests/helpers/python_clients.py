"""Python programs from PyPI, pinned, each in its own virtualenv cached outside the repo like
the Node clients: installed once per machine (setup, not test traffic). Without PyPI the
tests that need them FAIL: CI must run them. Aider (the version whose traffic the shipped
preset was written from), the official MCP SDK (both sides of the `mcp:` rule tests:
the gateway's own dependencies stay out of its resolution) and huggingface_hub (the
`service/huggingface` preset's client)."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path

from helpers.cache_lock import installing
from helpers.node_clients import cache_root

AIDER = "aider-chat==0.86.2"
MCP = "mcp==1.30.0"
HUGGINGFACE_HUB = "huggingface_hub==2.4.0"


def pypi_venv(spec: str) -> Path:
    """The root of a virtualenv with `spec` (`name==version`) installed, made once."""
    name, version = spec.split("==")
    root = cache_root() / f"{name}-{version}"
    with installing(root):
        if not (root / ".installed").is_file():
            shutil.rmtree(root, ignore_errors=True)  # a half-made one from an interrupted run
            subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=300)
            proc = subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "-q",
                                   "--disable-pip-version-check", spec],
                                  capture_output=True, text=True, timeout=900, check=False)
            assert proc.returncode == 0, f"pip install {spec} failed:\n{proc.stderr[-3000:]}"
            (root / ".installed").touch()
    return root


@functools.cache
def aider_cli() -> Path:
    """The `aider` executable of AIDER (checked once a process: it starts in seconds)."""
    aider = pypi_venv(AIDER) / "bin" / "aider"
    version = subprocess.run([str(aider), "--version"], capture_output=True, text=True,
                             timeout=120, check=False)
    assert version.stdout.strip() == f"aider {AIDER.split('==')[1]}", version
    return aider


@functools.cache
def mcp_python() -> Path:
    """A Python with the MCP SDK (MCP) importable (checked once a process)."""
    python = pypi_venv(MCP) / "bin" / "python"
    check = subprocess.run([str(python), "-c", "import mcp.client.streamable_http"],
                           capture_output=True, text=True, timeout=120, check=False)
    assert check.returncode == 0, check.stderr
    return python


def huggingface_python() -> Path:
    """A Python with huggingface_hub (HUGGINGFACE_HUB) importable: the Hub's own client
    (its downloads, its commit API)."""
    python = pypi_venv(HUGGINGFACE_HUB) / "bin" / "python"
    check = subprocess.run([str(python), "-c", "import huggingface_hub; "
                            "print(huggingface_hub.__version__)"],
                           capture_output=True, text=True, timeout=120, check=False)
    assert check.stdout.strip() == HUGGINGFACE_HUB.split("==")[1], check.stderr
    return python
