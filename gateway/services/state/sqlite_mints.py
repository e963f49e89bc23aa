"""The SQLite store's minted credentials, shared by the processes with the lease of the
one minting each (`MintShare`, see `gateway.services.minting.shared`), and rotated OAuth2
refresh tokens: `SqliteState`'s part for them."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from typing import Any

from gateway.services.state.base import SharedMint, StateUnavailable
from gateway.services.state.sqlite_connect import transaction
from gateway.services.state.sqlite_file import SqliteFile, json_text

__all__ = ["SqliteMints"]


class SqliteMints(SqliteFile):
    """Minted credentials and refresh tokens in the state file."""

    _refresh_tokens: dict[str, tuple[str, str]]  # written (or held) here

    def _mint_txn(self, op: str, sql: str, args: tuple[Any, ...]) -> int:
        """One statement in a write transaction: the rows it changed; StateUnavailable
        when the file cannot be written (the caller then mints for itself)."""
        try:
            with transaction(self._db()) as conn:
                changed = conn.execute(sql, args).rowcount
        except sqlite3.Error as exc:
            self._failed(op, exc)
            raise StateUnavailable(f"the state file cannot be written ({self._problem})") \
                from None
        self._recovered()
        return int(changed)

    async def read_mint(self, name: str) -> SharedMint | None:
        try:
            row = self._db().execute(
                "SELECT value, parts, minted_at, expires_at, due_at FROM minted WHERE name = ? "
                "AND value IS NOT NULL", (name,)).fetchone()
        except sqlite3.Error as exc:
            self._failed("read", exc)
            raise StateUnavailable(f"the state file cannot be read ({self._problem})") from None
        if row is None:
            return None
        value, parts, minted_at, expires_at, due_at = row
        return SharedMint(value, tuple(json.loads(parts or "[]")), minted_at, expires_at, due_at)

    async def lease_mint(self, name: str, holder: str, until: float) -> bool:
        return self._mint_txn(
            "mint", "INSERT INTO minted (name, lease_holder, lease_until) VALUES (?, ?, ?) "
            "ON CONFLICT(name) DO UPDATE SET lease_holder = excluded.lease_holder, "
            "lease_until = excluded.lease_until WHERE minted.lease_until IS NULL OR "
            "minted.lease_until <= ? OR minted.lease_holder = excluded.lease_holder",
            (name, holder, until, self.clock())) == 1

    async def write_mint(self, name: str, mint: SharedMint, holder: str) -> None:
        # (SET expressions read the row as it was: the lease is dropped only if held)
        self._mint_txn(
            "mint", "INSERT INTO minted (name, value, parts, minted_at, expires_at, due_at) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET value = excluded.value, "
            "parts = excluded.parts, minted_at = excluded.minted_at, expires_at = "
            "excluded.expires_at, due_at = excluded.due_at, lease_holder = CASE WHEN "
            "lease_holder = ? THEN NULL ELSE lease_holder END, lease_until = CASE WHEN "
            "lease_holder = ? THEN NULL ELSE lease_until END",
            (name, mint.value, json_text(list(mint.parts)), mint.minted_at, mint.expires_at,
             mint.due_at, holder, holder))

    async def release_mint(self, name: str, holder: str) -> None:
        with contextlib.suppress(StateUnavailable):  # (the lease lapses by itself)
            self._mint_txn("mint", "UPDATE minted SET lease_holder = NULL, lease_until = NULL "
                           "WHERE name = ? AND lease_holder = ?", (name, holder))

    async def read_refresh(self, key: str) -> tuple[str, str] | None:
        local = self._refresh_tokens.get(key)
        if local is not None and any(args[:1] == (key,) for _, args in self._held):
            return local  # (written here, not yet to the file)
        try:
            row = self._db().execute("SELECT origin, value FROM refresh_tokens WHERE key = ?",
                                     (key,)).fetchone()
        except sqlite3.Error as exc:
            self._failed("read", exc)
            if local is not None:
                return local
            raise StateUnavailable(f"the state file cannot be read ({self._problem})") from None
        return None if row is None else (row[0], row[1])

    async def write_refresh(self, key: str, origin: str, value: str) -> None:
        """Keep a rotated refresh token (held and retried if the file cannot be written:
        the token the server rotated to is never lost while this process runs)."""
        self._refresh_tokens[key] = (origin, value)
        self._change([("INSERT INTO refresh_tokens (key, origin, value, updated_at) VALUES "
                       "(?, ?, ?, ?) ON CONFLICT(key) DO UPDATE SET origin = excluded.origin, "
                       "value = excluded.value, updated_at = excluded.updated_at",
                       (key, origin, value, self.clock()))])

