"""Durations as people write them in config, policies and query strings: `15m`,
`1h30m`, `90s`, `250ms`, `2d`, or a number of seconds (pure).

Shared by the core, `gateway.config` (which re-exports `parse_duration`) and the policy
readers; a wrong value raises `ConfigError` (gateway/errors.py, a `ValueError`)."""

from __future__ import annotations

import math
import re

from gateway.errors import ConfigError

__all__ = ["parse_duration"]

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: object, key: str = "duration") -> float:
    """Seconds; ConfigError naming `key` and what to write for anything else, or for a
    duration that is not positive."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a duration like 15m, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        if re.fullmatch(r"\d+(\.\d+)?", text):
            seconds = float(text)
        else:
            parts = _DURATION.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise ConfigError(f"{key}: {value!r} is not a duration; use e.g. 90s, 15m, 1h30m")
            seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    else:
        raise ConfigError(f"{key}: expected a duration like 15m, got {type(value).__name__}")
    if not math.isfinite(seconds) or seconds <= 0:  # (JSON's NaN and Infinity too)
        raise ConfigError(f"{key}: must be positive and finite, got {value!r}")
    return seconds
