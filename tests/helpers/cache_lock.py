"""One installer at a time for a tool cached outside the repo (npm packages, virtualenvs,
hadolint): the suite runs on several processes (pytest-xdist), and two of them making the
same cache directory would remove each other's half-made copy."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def installing(root: Path) -> Iterator[None]:
    """Hold the lock of the cache directory `root` (a `.lock` file beside it) while its
    copy is checked and, if missing, made."""
    root.parent.mkdir(parents=True, exist_ok=True)
    with (root.parent / f"{root.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
