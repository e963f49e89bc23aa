"""`random_file`: made once, 0600, the same bytes for every reader after."""

from __future__ import annotations

import stat
from pathlib import Path

from gateway.services.keyfile import random_file


def test_made_once_private_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "key"
    first = random_file(path, 32)
    assert len(first) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert random_file(path, 32) == first  # (read, not made again)
    assert random_file(tmp_path / "other", 32) != first
    assert [p.name for p in path.parent.iterdir()] == ["key"]  # (no temporary left)
