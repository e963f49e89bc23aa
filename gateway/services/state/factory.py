"""The state store a configuration names (`state:` in gateway.yaml).

Kept apart from the store types so that `base` imports neither SQLite nor Redis: each
implementation is imported only when configured.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.core.durations import parse_duration
from gateway.services.state.base import MemoryState, StateStore
from gateway.services.state.health import unavailable_mode

__all__ = ["build_state"]


def build_state(config: Mapping[str, Any], base: Path | None = None) -> StateStore:
    """The store named by the `state` config section: `sqlite` (the default; `path`,
    relative to `base`, default `state/gateway.db`), `redis` (`url`, `prefix`) or
    `memory`; `unavailable` (every store: `serve` or `refuse`, services/state/health.py);
    `volume_check` (sqlite: how often the volume's free space is read, 1s to 1h)."""
    kind = config.get("store", "sqlite")
    known = {"sqlite": {"store", "path", "unavailable", "volume_check"},
             "redis": {"store", "url", "prefix", "unavailable"},
             "memory": {"store", "unavailable"}}
    if kind not in known:
        raise ValueError(f"state.store: {kind!r} is not a store; use sqlite, redis or memory")
    unknown = set(config) - known[kind]
    if unknown:
        raise ValueError(f"state.{sorted(unknown)[0]}: unknown key for store {kind} (known: "
                         f"{', '.join(sorted(known[kind]))})")
    unavailable_mode(config)
    if kind == "memory":
        return MemoryState()
    if kind == "sqlite":
        raw = config.get("path", "state/gateway.db")
        if not isinstance(raw, str | Path) or not str(raw):
            raise ValueError("state.path: the SQLite file's path, e.g. ./state/gateway.db")
        path = Path(raw).expanduser()
        if not path.is_absolute():
            path = (base or Path.cwd()) / path
        from gateway.services.state.sqlite import SqliteState

        return SqliteState(path, volume_check=_volume_check(config))
    url = config.get("url")
    if not isinstance(url, str) or not url:
        raise ValueError("state.url: required for store redis, e.g. redis://redis:6379/0")
    from gateway.services.state.redis import RedisState

    return RedisState(url, prefix=str(config.get("prefix", "sandbox-gateway")))


def _volume_check(config: Mapping[str, Any]) -> float:
    """`state.volume_check` in seconds (10 s by default): from 1 s (the store's
    background work runs once a second) to an hour."""
    seconds = parse_duration(config.get("volume_check", 10.0), "state.volume_check")
    if not 1.0 <= seconds <= 3600.0:
        raise ValueError(f"state.volume_check: from 1s to 1h, got {config['volume_check']!r}")
    return seconds
