"""A real, tiny tmpfs: a disk that fills up (needs root, as CI runs)."""

from __future__ import annotations

import contextlib
import os
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


def fill(directory: Path) -> Path:
    """Fill the file system `directory` is on to its last block with one file (returned:
    unlink it to free the space). Unbuffered writes, smaller and smaller: no slack is left
    for a small write (a SQLite page) to slip into."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 20, 65536, 4096, 512, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    return filler
