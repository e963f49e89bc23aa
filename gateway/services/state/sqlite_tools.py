"""The state store's files seen from outside a running store: `state check` (is the
file sound, what it holds, how big the files are), `state backup` (an online copy), and
the free space of the volume holding them (read by the store every few seconds, and by
`state check`)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

from gateway.services.state.sqlite_connect import prepare
from gateway.services.state.sqlite_log import log_path
from gateway.services.state.sqlite_schema import SCHEMA_VERSION

__all__ = ["FREE_FLOOR", "FREE_SHARE", "backup_file", "check_file", "counts", "file_sizes",
           "log_summary", "summary", "volume", "volume_warning"]

# /readyz warns (and the request log stops growing) when the state volume has less free
# than FREE_SHARE of its size or FREE_FLOOR bytes, whichever is more.
FREE_SHARE = 0.10
FREE_FLOOR = 64 * 1024 * 1024


def volume_warning(free: int, total: int) -> str | None:
    """Why the state volume is short of space (below `FREE_SHARE` of its size or
    `FREE_FLOOR` bytes, whichever is more), or None."""
    floor = max(FREE_FLOOR, int(total * FREE_SHARE))
    if total <= 0 or free >= floor:
        return None
    return (f"the state volume has {free // (1024 * 1024)} MiB free of "
            f"{total // (1024 * 1024)} MiB (below {floor // (1024 * 1024)} MiB: "
            f"{FREE_SHARE:.0%} or {FREE_FLOOR // (1024 * 1024)} MiB): the request log no "
            "longer grows; free space or grow the volume before the state cannot be written")


def volume(path: Path) -> tuple[int, int]:
    """Free bytes (for an unprivileged user) and size of the volume holding `path`."""
    st = os.statvfs(path.parent if not path.is_dir() else path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def file_sizes(path: Path) -> dict[str, int]:
    """Bytes of the store's files that exist: state, state_wal, log, log_wal."""
    out = {}
    for name, file in (("state", path), ("state_wal", path.with_name(path.name + "-wal")),
                       ("log", log_path(path)),
                       ("log_wal", log_path(path).with_name(log_path(path).name + "-wal"))):
        with contextlib.suppress(OSError):
            out[name] = file.stat().st_size
    return out


def check_file(path: Path) -> list[str]:
    """What is wrong with a state file (`state check`): an empty list when it is a
    sound database of a schema this gateway knows."""
    if not path.exists():
        return [f"{path}: no such file"]
    problems = []
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                problems.append(f"{path}: schema version {version} is newer than this "
                                f"gateway's ({SCHEMA_VERSION})")
            result = [r[0] for r in conn.execute("PRAGMA integrity_check").fetchall()]
            if result != ["ok"]:
                problems.extend(f"{path}: {line}" for line in result[:20])
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        problems.append(f"{path}: {exc}")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        problems.append(f"{path}: mode {mode:o} lets others read it (it holds secrets a "
                        "provider minted and token ids): chmod 600")
    return problems

_TABLES = ("revoked", "sandboxes", "ephemeral", "counters", "minted", "refresh_tokens",
           "records", "log", "leases")  # (log: in files of schema 4 to 6)


def counts(conn: sqlite3.Connection) -> dict[str, int]:
    """Rows per table (of those the file's schema version has)."""
    present = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    return {name: int(conn.execute(f"SELECT count(*) FROM {name}").fetchone()[0])  # noqa: S608
            for name in _TABLES if name in present}


def summary(path: Path) -> tuple[int, dict[str, int]]:
    """The schema version and rows per table of the file at `path`, read-only (`state
    check`; no values)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:
        return int(conn.execute("PRAGMA user_version").fetchone()[0]), counts(conn)
    finally:
        conn.close()


def log_summary(path: Path) -> tuple[int, int] | None:
    """Lines in the request log of the state file `path` and the bytes of its pages in
    use, read-only; None when it has none (yet)."""
    file = log_path(path)
    if not file.exists():
        return None
    conn = sqlite3.connect(f"file:{file}?mode=ro", uri=True, timeout=5)
    try:
        lines = int(conn.execute("SELECT count(*) FROM log").fetchone()[0])
        pages, free, page = (int(conn.execute(f"PRAGMA {name}").fetchone()[0])
                             for name in ("page_count", "freelist_count", "page_size"))
        return lines, (pages - free) * page
    except sqlite3.Error:
        return None
    finally:
        conn.close()


def backup_file(source: Path, target: Path) -> None:
    """Copy the database at `source` to `target` online (SQLite's backup API: a
    consistent snapshot while the gateway keeps writing), mode 0600."""
    prepare(target)
    src = sqlite3.connect(f"file:{source}?mode=ro", uri=True, timeout=30)
    try:
        dst = sqlite3.connect(str(target))
        try:
            src.backup(dst)
        finally:
            dst.close()
    finally:
        src.close()
    os.chmod(target, 0o600)

