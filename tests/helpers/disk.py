"""A real, tiny tmpfs: a disk that fills up (needs root, as CI runs)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def tiny_tmpfs(directory: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of `size` (e.g. "64k") on `directory` for a fixture, unmount it
    afterwards; skip the test where mounting is not allowed."""
    directory.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                           str(directory)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)
