"""The console's request log in its own SQLite file (gateway/services/state/sqlite_log.py):
apart from the state, bounded in bytes as well as lines, never growing past its bound,
holding its size while the state volume is short; a state file of schema 5 loses its
log table (and the space) on upgrade; `state check` reports the sizes."""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.clock import run
from helpers.disk import tiny_tmpfs

from gateway.cli import main
from gateway.services.state.counters import Admission, Limit
from gateway.services.state.log import LogEntry, LogQuery
from gateway.services.state.sqlite import SqliteState
from gateway.services.state.sqlite_log import WAL_LIMIT, log_path
from gateway.services.state.sqlite_schema import MIGRATIONS, SCHEMA_VERSION
from gateway.services.state.sqlite_tools import summary

FAR = time.time() + 3600
MIB = 1024 * 1024


def _entries(start: int, count: int, size: int = 400) -> list[LogEntry]:
    """Audit-line-like entries of about `size` bytes."""
    out = []
    for n in range(start, start + count):
        record = {"n": n, "sandbox": f"sbx-{n % 7}", "policy": "agent", "host": "api.test",
                  "decision": "allow", "engine": "h1", "path": "/v1/" + "p" * size}
        out.append(LogEntry.of(record, 1_000_000.0 + n, json.dumps(record)))
    return out


def _newest(state: SqliteState, count: int) -> list[int]:
    rows = run(state.log_read(LogQuery(), count))
    return [json.loads(entry.line)["n"] for _, entry in rows]


@contextlib.contextmanager
def opened(path: Path, *, lines: int = 0, size: int = 0) -> Iterator[SqliteState]:
    state = SqliteState(path)
    run(state.start())
    state.log_retain, state.log_retain_bytes = lines, size
    try:
        yield state
    finally:
        run(state.close())


def test_the_log_has_its_own_private_file_and_leaves_the_state_small(tmp_path: Path) -> None:
    path = tmp_path / "state" / "gateway.db"
    with opened(path, lines=100_000, size=100_000 * 1024) as state:
        for start in range(0, 5000, 250):
            run(state.log_append(_entries(start, 250)))
        run(state.revoke("j", FAR))
    log = log_path(path)
    assert log == tmp_path / "state" / "gateway-requests.db"
    assert log.stat().st_mode & 0o777 == 0o600
    version, rows = summary(path)
    assert version == SCHEMA_VERSION and rows["revoked"] == 1 and "log" not in rows
    assert path.stat().st_size < 256 * 1024  # 5,000 lines of ~500 bytes went elsewhere
    assert log.stat().st_size > 2 * MIB


def test_a_bound_in_bytes_holds_the_file_at_its_size(tmp_path: Path) -> None:
    """4 MB of lines into a log of 1 MiB: the file stays within the bound and a batch's
    room, its WAL within its limit, the newest lines are the ones kept."""
    path = tmp_path / "gateway.db"
    with opened(path, size=1 * MIB) as state:
        for start in range(0, 8000, 250):
            run(state.log_append(_entries(start, 250)))
            assert log_path(path).stat().st_size <= 2 * MIB + 4096
        used = state.requests.used_bytes()
        assert 0.8 * MIB <= used <= 1 * MIB + 64 * 1024
        newest = _newest(state, 10_000)
        assert newest[0] == 7999 and newest == list(range(7999, 7999 - len(newest), -1))
        assert 1500 < len(newest) < 2400, len(newest)  # ~500 bytes a line
        wal = log_path(path).with_name(log_path(path).name + "-wal")
        assert wal.stat().st_size <= WAL_LIMIT + 64 * 1024


def test_a_bound_in_lines_keeps_exactly_that_many(tmp_path: Path) -> None:
    with opened(tmp_path / "gateway.db", lines=300, size=300 * 1024) as state:
        for start in range(0, 1000, 100):
            run(state.log_append(_entries(start, 100)))
        assert _newest(state, 1000) == list(range(999, 699, -1))


def test_a_lowered_bound_gives_the_space_back(tmp_path: Path) -> None:
    path = tmp_path / "gateway.db"
    with opened(path, size=4 * MIB) as state:
        for start in range(0, 10_000, 500):
            run(state.log_append(_entries(start, 500)))
    assert log_path(path).stat().st_size > 3 * MIB
    with opened(path, size=1 * MIB) as state:  # console.retain lowered, restarted
        run(state.log_append(_entries(10_000, 10)))
        assert log_path(path).stat().st_size <= 2 * MIB + 4096
        assert _newest(state, 1)[0] == 10_009


def test_held_while_the_volume_is_short_the_log_does_not_grow(tmp_path: Path) -> None:
    path = tmp_path / "gateway.db"
    with opened(path, size=64 * MIB) as state:
        run(state.log_append(_entries(0, 500)))
        state.requests.hold(True)
        before = state.requests.used_bytes()
        for start in range(500, 5000, 250):
            run(state.log_append(_entries(start, 250)))
        assert state.requests.used_bytes() <= before + 64 * 1024
        assert _newest(state, 1) == [4999]  # new lines replace the oldest
        state.requests.hold(False)
        run(state.log_append(_entries(5000, 2000)))
        assert state.requests.used_bytes() > before + MIB  # grows to its bound again


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    yield from tiny_tmpfs(tmp_path / "volume", "24m")


def test_metered_load_on_a_small_volume_never_takes_the_state_down(
        small_volume: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The request log used to be a table of the state file: on a small volume metered
    load filled the last MiB with lines within seconds and the state store was out
    (revocations and budgets not written). On a 24 MiB volume with the default bound
    (100,000 lines, about 98 MiB: more than the volume), 12 MB of lines go by; revocations
    and budget admissions are written throughout, and the log holds its size."""
    caplog.set_level(logging.WARNING, "sandbox_gateway.state")
    path = small_volume / "state" / "gateway.db"
    with opened(path, lines=100_000, size=100_000 * 1024) as state:
        assert state.warning is not None and "request log no longer grows" in state.warning
        limit = Admission((Limit((("b", "r"),), 10**9, 1),), (("b", "r", 1, FAR),))
        for batch in range(120):
            run(state.log_append(_entries(batch * 250, 250)))
            assert state.admit(limit) is None
            run(state.revoke(f"j{batch}", FAR))
            assert state.problem is None, state.problem
        assert log_path(path).stat().st_size < 2 * MIB
        other = SqliteState(path)  # another worker's view
        run(other.start())
        try:
            assert other.is_revoked("j119") and other.counter("b", "r") == 120
        finally:
            run(other.close())
    assert any("state volume has" in r.message for r in caplog.records)


def test_an_old_file_loses_its_log_table_and_the_space(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Upgrade from schema 5: the log table is dropped (its lines are in the audit trail;
    the console's log starts empty in its own file) and the file shrinks; the state stays."""
    caplog.set_level(logging.WARNING, "sandbox_gateway.state")
    path = tmp_path / "gateway.db"
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        for version in range(1, 6):
            for statement in MIGRATIONS[version]:
                conn.execute(statement)
        conn.execute("INSERT INTO revoked VALUES ('kept', ?)", (FAR,))
        with conn:  # one transaction (row by row, each its own commit: 35-58 s of syncs)
            conn.execute("BEGIN")
            conn.executemany("INSERT INTO log (at, sandbox, policy, host, decision, code, "
                             "engine, line) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                             _entries(0, 20_000))
        conn.execute("PRAGMA user_version=5")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    path.chmod(0o600)
    before = path.stat().st_size
    assert before > 8 * MIB and summary(path)[1]["log"] == 20_000
    with opened(path, lines=1000, size=1000 * 1024) as state:
        assert state.is_revoked("kept")
        assert run(state.log_last()) == "0"
    version, rows = summary(path)
    assert version == SCHEMA_VERSION and "log" not in rows and rows["revoked"] == 1
    assert path.stat().st_size < before / 20
    assert any("request log moved to gateway-requests.db" in r.message
               for r in caplog.records)


def test_state_check_reports_the_sizes_and_the_room_left(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("state: {store: sqlite, path: var/gateway.db}\n")
    path = tmp_path / "var" / "gateway.db"
    with opened(path, lines=1000, size=1000 * 1024) as state:
        run(state.log_append(_entries(0, 300)))
    assert main(["state", "check", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "sizes: state " in out and " log " in out
    assert "request log: 300 lines in " in out
    assert "volume: " in out and " free of " in out and out.rstrip().endswith("OK")


def test_a_batch_is_written_off_the_event_loop(tmp_path: Path) -> None:
    """A batch of lines (3-5 ms for a few hundred, 25 at a checkpoint, measured) is
    written in a thread: the event loop, which serves every request of the process,
    goes on meanwhile (it waited for each before the twenty-second session); reads and
    writes from several threads at once each use the connection whole."""
    import asyncio
    import threading

    with opened(tmp_path / "gateway.db") as state:
        log = state.requests
        ticked, waited = threading.Event(), []
        written = log.append

        def slow(entries: list[LogEntry]) -> None:
            waited.append(ticked.wait(3))  # (until the loop has run meanwhile, or not)
            written(entries)

        log.append = slow  # type: ignore[method-assign]

        async def both() -> None:
            writing = asyncio.ensure_future(state.log_append(_entries(0, 10)))
            for _ in range(20):  # (the loop runs while the write waits)
                await asyncio.sleep(0.001)
            ticked.set()
            await writing

        run(both())
        assert waited == [True]
        del log.append
        assert _newest(state, 10) == list(range(9, -1, -1))

        async def crowd() -> None:
            await asyncio.gather(*(state.log_append(_entries(100 + 50 * i, 50))
                                   for i in range(8)),
                                 *(state.log_read(LogQuery(), 20) for _ in range(8)))

        run(crowd())
        assert len(_newest(state, 1000)) == 410
