"""The state file's schema (gateway/services/state/sqlite_schema.py): a new file is private
and current, older files are migrated keeping their rows, a newer or corrupt file is
refused with the path and what to do."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from pathlib import Path

import pytest
from helpers.clock import run

from gateway.core.secret_value import SecretValue
from gateway.services.secrets.ephemeral import EphemeralKey
from gateway.services.state.base import StateUnavailable
from gateway.services.state.sqlite import SqliteState
from gateway.services.state.sqlite_schema import MIGRATIONS, SCHEMA_VERSION
from gateway.services.state.sqlite_tools import check_file, summary

FAR = time.time() + 3600


def started(path: Path) -> SqliteState:
    state = SqliteState(path)
    run(state.start())
    return state


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
    assert version == SCHEMA_VERSION == 8 and rows["refresh_tokens"] == 1 and rows["records"] == 0 \
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
