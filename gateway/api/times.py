"""Times people give the admin API and the console: a moment or a duration back."""

from __future__ import annotations

import datetime as dt

from gateway.config import ConfigError, parse_duration

__all__ = ["parse_since"]


def parse_since(value: str, now: float) -> float:
    """``since`` of ``/v1/usage``: an ISO 8601 time (UTC if no offset) or a duration back
    from now (``24h``, ``7d``). Raises ValueError."""
    try:
        return now - parse_duration(value, "since")
    except ConfigError:
        pass
    try:
        at = dt.datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"since {value[:64]!r} is neither an ISO 8601 time "
                         "(2026-11-22T00:00:00Z) nor a duration (24h)") from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=dt.UTC)
    return at.timestamp()
