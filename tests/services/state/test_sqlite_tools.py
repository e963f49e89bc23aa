"""The state store's tools (gateway/services/state/sqlite_tools.py): `state check` on sound
and damaged files, an online backup while a process writes, the state volume's warning."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers.clock import run

from gateway.cli import main
from gateway.services.state.sqlite import SqliteState
from gateway.services.state.sqlite_schema import SCHEMA_VERSION
from gateway.services.state.sqlite_tools import FREE_FLOOR, check_file, summary, volume_warning

ROOT = Path(__file__).resolve().parents[3]
FAR = time.time() + 3600
MIB = 1024 * 1024


def started(path: Path) -> SqliteState:
    state = SqliteState(path)
    run(state.start())
    return state


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


@pytest.mark.parametrize(("free", "total", "warns"), [
    (200 * MIB, 1024 * MIB, False),
    (100 * MIB, 1024 * MIB, True),  # below 10 % of the volume
    (FREE_FLOOR - 1, 100 * MIB, True),  # below the 64 MiB floor
    (FREE_FLOOR + 1, 100 * MIB, False),
    (0, 0, False),  # (no size to judge by)
])
def test_when_the_state_volume_is_short(free: int, total: int, warns: bool) -> None:
    warning = volume_warning(free, total)
    assert (warning is not None) == warns
    if warning:
        assert f"{free // MIB} MiB free" in warning and "request log no longer grows" in warning
