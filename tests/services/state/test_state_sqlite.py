"""The SQLite state file itself: schema versions, modes, a corrupt file, a full disk (a
real tiny tmpfs), a process killed with SIGKILL in the middle of its transactions, and
the `state check` / `state backup` commands on a file a live process keeps writing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.clock import run
from helpers.disk import fill as fill_up
from helpers.disk import tiny_tmpfs

from gateway.cli import main
from gateway.core.secret_value import SecretValue
from gateway.observability import metrics
from gateway.services.secrets.ephemeral import EphemeralKey
from gateway.services.state.base import SandboxAddress, StateUnavailable
from gateway.services.state.counters import Admission, Limit
from gateway.services.state.sqlite import (
    MIGRATIONS,
    SCHEMA_VERSION,
    SqliteState,
    check_file,
    summary,
)

ROOT = Path(__file__).resolve().parents[3]
FAR = time.time() + 3600


def started(path: Path) -> SqliteState:
    state = SqliteState(path)
    run(state.start())
    return state


def up() -> float:
    return metrics.STATE_STORE_UP.labels(store="sqlite")._value.get()  # type: ignore[attr-defined, no-any-return]


def test_created_private_with_the_current_schema(tmp_path: Path) -> None:
    path = tmp_path / "state" / "gateway.db"
    run(started(path).close())
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert check_file(path) == []


def test_an_empty_database_is_migrated_and_a_current_one_kept(tmp_path: Path) -> None:
    path = tmp_path / "gateway.db"
    sqlite3.connect(path).close()  # version 0: no tables
    path.chmod(0o600)
    state = started(path)
    run(state.revoke("j", FAR))
    run(state.close())
    again = started(path)  # at the current version: nothing re-applied, nothing lost
    assert again.is_revoked("j")
    run(again.close())


def test_a_version_1_file_is_migrated_keeping_its_rows(tmp_path: Path) -> None:
    """The file of the first SQLite release (no minted credentials) gains the tables of
    version 2 at start; its revocations and counters stay."""
    path = tmp_path / "gateway.db"
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        for statement in MIGRATIONS[1]:
            conn.execute(statement)
        conn.execute("INSERT INTO revoked VALUES ('j1', ?)", (FAR,))
        conn.execute("INSERT INTO counters VALUES ('b', 't:sb', 9000, ?)", (FAR,))
        conn.execute("PRAGMA user_version=1")
    path.chmod(0o600)
    assert summary(path)[0] == 1 and "minted" not in summary(path)[1]
    state = started(path)
    assert state.is_revoked("j1") and state.counter("b", "t:sb") == 9000
    assert run(state.read_refresh("k")) is None
    run(state.write_refresh("k", "o", "rt-1"))
    run(state.close())
    version, rows = summary(path)
    assert version == SCHEMA_VERSION == 7 and rows["refresh_tokens"] == 1 and rows["records"] == 0 \
        and "log" not in rows and rows["leases"] == 0  # (the request log: its own file)


def test_minted_secrets_from_before_aliases_stay_markers(tmp_path: Path) -> None:
    """A version 4 file's provider-minted secrets (relayed in clear then, no alias) are
    kept as leak markers until they expire, never found by an alias; secrets minted
    after the upgrade are written with their alias and read back by it."""
    path = tmp_path / "gateway.db"
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        for version in range(1, 5):
            for statement in MIGRATIONS[version]:
                conn.execute(statement)
        conn.execute("INSERT INTO ephemeral VALUES ('d', 'openai', 'sb', 'ek_old_0123456789', "
                     "?)", (FAR,))
        conn.execute("PRAGMA user_version=4")
    path.chmod(0o600)
    state = started(path)
    [old] = state.ephemeral.live()
    assert old.value.equals("ek_old_0123456789") and old.alias is None
    assert state.ephemeral.by_alias("ek_old_0123456789") is None
    state.ephemeral.add(EphemeralKey("openai", "sb", SecretValue("ek_new_0123456789"), FAR,
                                     SecretValue("ek_alias_0123456789")))
    run(state.close())
    again = started(path)
    found = again.ephemeral.by_alias("ek_alias_0123456789")
    assert found is not None and found.value.equals("ek_new_0123456789")
    assert len(again.ephemeral.live()) == 2
    run(again.close())


def test_a_newer_schema_is_refused_with_both_versions(tmp_path: Path) -> None:
    path = tmp_path / "gateway.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    with pytest.raises(StateUnavailable) as caught:
        run(SqliteState(path).start())
    message = str(caught.value)
    assert str(path) in message
    assert f"schema version {SCHEMA_VERSION + 1}" in message
    assert f"up to {SCHEMA_VERSION}" in message and "state backup" in message


def test_a_corrupt_file_is_refused_with_the_path_and_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "gateway.db"
    path.write_bytes(b"this is not a database, just bytes" * 200)
    path.chmod(0o600)
    with pytest.raises(StateUnavailable) as caught:
        run(SqliteState(path).start())
    message = str(caught.value)
    assert str(path) in message and "state check" in message and "backup" in message
    assert any("not a database" in p for p in check_file(path))


def test_a_damaged_page_is_found_by_check(tmp_path: Path) -> None:
    path = tmp_path / "gateway.db"
    state = started(path)
    state.count([("t", f"f{i}", i, FAR) for i in range(3000)])  # several pages
    state.flush()
    run(state.close())
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) > 4 * page
    for start in range(page, len(data), page):  # every b-tree page's header
        data[start: start + 12] = b"\xff" * 12
    path.write_bytes(bytes(data))
    assert check_file(path), "integrity_check should report the damaged page"


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    yield from tiny_tmpfs(tmp_path / "disk", "2m")


def fill(disk: Path) -> Path:
    filler = disk / "filler"
    with open(filler, "wb") as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * 65536)
            out.flush()
    return filler


def test_a_full_disk_keeps_enforcing_and_writes_what_it_held_later(tiny_disk: Path) -> None:
    path = tiny_disk / "state" / "gateway.db"

    async def scenario() -> None:
        state = SqliteState(path)
        await state.start()
        try:
            state.count([("usage", "sb", 5, FAR)])
            state.flush()
            filler = fill(tiny_disk)
            # A revocation: holds here at once, the caller is told it is not shared yet.
            with pytest.raises(StateUnavailable, match="is held in this process"):
                await state.revoke("j-full", FAR)
            assert state.is_revoked("j-full")
            # Counting goes on locally (many rows: more than the WAL's free pages).
            state.count([("usage", f"f{i}", 1, FAR) for i in range(4000)])
            state.count([("usage", "sb", 7, FAR)])
            state.flush()
            assert state.problem is not None and "full" in state.problem
            assert state.counters_degraded and up() == 0
            assert state.counter("usage", "sb") == 12
            # Admission decides on this process's reading meanwhile.
            limit = Admission((Limit((("b", "r"),), 2, 1),), (("b", "r", 1, FAR),))
            assert [state.admit(limit) for _ in range(3)] == [None, None, 0]
            # Space returns: the retry (every second) writes everything that was held.
            filler.unlink()
            deadline = time.monotonic() + 5
            while state.problem is not None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert state.problem is None and up() == 1
            other = SqliteState(path)  # another process's view of the file
            await other.start()
            try:
                assert other.is_revoked("j-full")
                assert other.counter("usage", "sb") == 12
                assert other.counter("usage", "f3999") == 1
                assert other.counter("b", "r") == 2
            finally:
                await other.close()
        finally:
            await state.close()

    run(scenario())


def test_every_process_notices_a_full_disk_and_its_end(tiny_disk: Path) -> None:
    """Not only the process whose write failed: one that writes nothing probes the file
    (`problem`, `/readyz`), and sees the disk come back within seconds."""
    path = tiny_disk / "state" / "gateway.db"

    async def scenario() -> None:
        writer, idle = SqliteState(path), SqliteState(path)
        await writer.start()
        await idle.start()
        try:
            filler = fill_up(tiny_disk)
            # Revoked twice while full: one change held, written once.
            for _ in range(2):
                with pytest.raises(StateUnavailable, match="is held in this process"):
                    await writer.revoke("j-full", FAR)
            assert len(writer._held) == 1
            deadline = time.monotonic() + 6
            while idle.problem is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert idle.problem is not None and "full" in idle.problem
            filler.unlink()
            deadline = time.monotonic() + 4
            while (idle.problem or writer.problem) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert idle.problem is None and writer.problem is None
            assert idle.is_revoked("j-full")
        finally:
            await writer.close()
            await idle.close()

    run(scenario())


def test_a_registration_on_a_full_disk_is_refused_not_half_done(tiny_disk: Path) -> None:
    path = tiny_disk / "gateway.db"

    async def scenario() -> None:
        state = SqliteState(path)
        await state.start()
        try:
            filler = fill(tiny_disk)
            with pytest.raises(StateUnavailable, match="is not registered"):
                await state.register_sandbox(SandboxAddress("s1", "10.0.0.9", "agent"))
            assert state.sandbox_for("10.0.0.9") is None
            filler.unlink()
            await asyncio.sleep(1.3)  # a retry: nothing held for it
            assert state.sandbox_for("10.0.0.9") is None
        finally:
            await state.close()

    run(scenario())


KILLED = textwrap.dedent("""\
    import asyncio, sys, time
    from pathlib import Path
    from gateway.services.state.counters import Admission, Limit
    from gateway.services.state.sqlite import SqliteState
    async def main():
        s = SqliteState(Path(sys.argv[1]))
        await s.start()
        i = 0
        while True:
            i += 1
            s.admit(Admission((Limit((("b", "r"),), 10**9, 1),),
                              (("b", "r", 1, time.time() + 600),)))
            await s.revoke(f"j{i}", time.time() + 600)
            print(i, flush=True)  # (both committed)
    asyncio.run(main())
""")


def test_a_process_killed_mid_transaction_loses_nothing_committed(tmp_path: Path) -> None:
    path = tmp_path / "gateway.db"
    run(started(path).close())
    with subprocess.Popen([sys.executable, "-c", KILLED, str(path)], text=True,
                          stdout=subprocess.PIPE,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}) as proc:
        assert proc.stdout is not None
        acknowledged = 0
        while acknowledged < 40:
            acknowledged = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        rest = proc.stdout.read().split()
    acknowledged = int(rest[-1]) if rest else acknowledged
    assert check_file(path) == []
    state = started(path)
    try:
        count = state.counter("b", "r")
        assert acknowledged <= count <= acknowledged + 1  # (+ one committed, not yet said)
        assert all(state.is_revoked(f"j{i}") for i in range(1, acknowledged + 1))
    finally:
        run(state.close())


WRITER = textwrap.dedent("""\
    import asyncio, sys, time
    from pathlib import Path
    from gateway.services.state.sqlite import SqliteState
    async def main():
        s = SqliteState(Path(sys.argv[1]))
        await s.start()
        await s.revoke("before-backup", time.time() + 600)
        print("ready", flush=True)
        i = 0
        while True:  # a transaction per iteration: writing the whole time
            s.count([("usage", f"f{i % 500}", 1, time.time() + 600)])
            s.flush()
            i += 1
            await asyncio.sleep(0)
    asyncio.run(main())
""")


def test_state_check_and_an_online_backup(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("state: {store: sqlite, path: var/state.db}\n")
    path = tmp_path / "var" / "state.db"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], text=True,
                              stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    with writer:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # (writing counters the whole time)
        assert main(["state", "check", "--config", str(config)]) == 0
        out = capsys.readouterr().out
        assert f"{path}: schema {SCHEMA_VERSION}, 1 revoked" in out and "OK" in out
        backup = tmp_path / "backups" / "state-copy.db"
        assert main(["state", "backup", "--config", str(config), str(backup)]) == 0
        assert main(["state", "backup", "--config", str(config), str(backup)]) == 1
        assert "--force" in capsys.readouterr().err
        assert writer.poll() is None  # the gateway kept running through it
        writer.kill()
    assert backup.stat().st_mode & 0o777 == 0o600
    assert check_file(backup) == []
    version, rows = summary(backup)
    assert version == SCHEMA_VERSION and rows["revoked"] == 1 and rows["counters"] > 0
    # Restore: the copy is a state file a gateway starts on.
    restored = started(backup)
    assert restored.is_revoked("before-backup")
    run(restored.close())


def test_state_commands_report_problems(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "junk.db"
    junk.write_text("junk")
    assert main(["state", "check", str(junk)]) == 1
    out = capsys.readouterr().out
    assert "not a database" in out and "chmod 600" in out and "FAILED" in out
    redis = tmp_path / "redis.yaml"
    redis.write_text("state: {store: redis, url: 'redis://127.0.0.1:1'}\n")
    assert main(["state", "backup", "--config", str(redis), str(tmp_path / "x.db")]) == 1
    assert "works on the SQLite file" in capsys.readouterr().err
    missing = tmp_path / "missing.yaml"
    missing.write_text(f"state: {{store: sqlite, path: {tmp_path / 'none.db'}}}\n")
    assert main(["state", "backup", "--config", str(missing), str(tmp_path / "y.db")]) == 1
    assert "no state file" in capsys.readouterr().err


OPENER = textwrap.dedent("""\
    import asyncio, sys, time
    from pathlib import Path
    from gateway.services.state.sqlite import SqliteState
    async def main():
        time.sleep(max(0.0, float(sys.argv[2]) - time.time()))  # all at once
        s = SqliteState(Path(sys.argv[1]))
        await s.start()
        await s.revoke(sys.argv[3], time.time() + 600)
        await s.close()
    asyncio.run(main())
""")


def test_processes_creating_the_file_together_all_start(tmp_path: Path) -> None:
    """Workers started at once on a file that does not exist yet (WAL set-up takes an
    exclusive lock that SQLite does not wait for): every one starts, nothing lost."""
    path = tmp_path / "new" / "gateway.db"
    at = str(time.time() + 1.5)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", OPENER, str(path), at, f"j{i}"],
                              env=env, stderr=subprocess.PIPE, text=True) for i in range(6)]
    errors = [p.communicate(timeout=60)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, errors
    state = started(path)
    assert all(state.is_revoked(f"j{i}") for i in range(6))
    run(state.close())
