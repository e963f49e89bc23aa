"""Writes to the state file heard from inotify (services/state/file_changes.py): the file
and its `-wal`/`-journal` companions count, other files in the directory do not, and a
directory that cannot be watched gives None (the watcher then polls)."""

from __future__ import annotations

import select
from pathlib import Path

from gateway.services.state.file_changes import FileChanges


def _readable(changes: FileChanges) -> bool:
    return bool(select.select([changes.fileno()], [], [], 1.0)[0])


def test_writes_to_the_file_and_its_companions_are_heard_and_others_are_not(
        tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    changes = FileChanges.open(db)
    assert changes is not None
    try:
        assert not changes.read()
        (tmp_path / "state.db.log").write_text("x")  # (another file: "state.db" + ".log")
        (tmp_path / "other").write_text("x")
        assert _readable(changes) and not changes.read()
        for name in ("state.db", "state.db-wal", "state.db-journal"):
            with (tmp_path / name).open("ab") as f:
                f.write(b"x")
                f.flush()
            assert _readable(changes) and changes.read(), name
            assert not changes.read()  # (taken)
    finally:
        changes.close()


def test_a_directory_that_cannot_be_watched_gives_none(tmp_path: Path) -> None:
    assert FileChanges.open(tmp_path / "missing" / "state.db") is None
