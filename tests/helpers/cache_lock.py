"""One installer at a time for a tool cached outside the repo (npm packages, virtualenvs,
hadolint): the suite runs on several processes (pytest-xdist), and two of them making the
same cache directory would remove each other's half-made copy."""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
from collections.abc import Callable, Iterator
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


def built_once(parent: Path, name: str, key: object, build: Callable[[Path], None]) -> Path:
    """`parent/<name>-<hash of key>`, made once by `build` (given the empty directory):
    a tool the suite compiles (javac, go build) kept across runs; `key` holds what the
    result depends on (its sources, the compiler's path), so a change builds it anew."""
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12]
    root = parent / f"{name}-{digest}"
    with installing(root):
        if not (root / ".installed").is_file():
            shutil.rmtree(root, ignore_errors=True)  # (a half-made one)
            root.mkdir(parents=True)
            build(root)
            (root / ".installed").touch()
    return root
