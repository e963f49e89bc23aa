"""A file of random bytes made once and shared by every process that reads it (the DLP
fingerprint salt, the MCP OAuth sealing key): written whole to a file of its own, then
linked into place, so workers starting together agree on one and never read a
half-written file (`os.link` fails if another got there first; that one is read)."""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from pathlib import Path

__all__ = ["random_file"]


def random_file(path: Path, size: int) -> bytes:
    """The bytes in `path`, `size` random ones written there (0600) if it does not
    exist. Raises OSError."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:  # (mkstemp: 0600)
            f.write(secrets.token_bytes(size))
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):  # (another's came first: theirs)
            os.link(tmp, path)
    finally:
        os.unlink(tmp)
    return path.read_bytes()
