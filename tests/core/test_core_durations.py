"""Durations as people write them (`15m`, `1h30m`, `250ms`, seconds): the one parser that
config, policies (`ttl`, `ask.timeout`, budget windows) and query strings (`?ttl=`) share
(pure, table-driven). `tests/test_config.py` checks the config's wrapper (ConfigError)."""

from __future__ import annotations

import math

import pytest

from gateway.core.durations import parse_duration

SECONDS: list[tuple[object, float]] = [
    ("250ms", 0.25),
    ("90s", 90),
    ("15m", 900),
    ("1h", 3600),
    ("2d", 172800),
    ("1h30m", 5400),
    ("1m1ms", 60.001),  # `ms` is read before `m`
    ("1d2h3m4s", 93784),
    ("30s30s", 60),  # units may repeat: the parts add up
    ("1.5h", 5400),
    (" 15M ", 900),  # case and surrounding blanks do not matter
    ("45", 45),
    ("2.5", 2.5),
    (30, 30),
    (0.5, 0.5),
]


@pytest.mark.parametrize(("value", "seconds"), SECONDS)
def test_a_duration_is_read_as_seconds(value: object, seconds: float) -> None:
    assert parse_duration(value) == pytest.approx(seconds)


REFUSED: list[tuple[object, str]] = [
    ("", "is not a duration; use e.g. 90s, 15m, 1h30m"),
    ("m", "is not a duration"),
    ("15x", "is not a duration"),
    ("m15", "is not a duration"),
    ("1m30", "is not a duration"),  # a number without its unit after a part
    ("1h 30m", "is not a duration"),
    ("15 m", "is not a duration"),
    ("1mm", "is not a duration"),
    ("1.h", "is not a duration"),
    ("1e3", "is not a duration"),
    ("-5m", "is not a duration"),
    ("-5", "is not a duration"),
    ("nan", "is not a duration"),
    ("0", "must be positive and finite, got '0'"),
    ("0s", "must be positive and finite"),
    ("0ms", "must be positive and finite"),
    (0, "must be positive and finite, got 0"),
    (-1, "must be positive and finite"),
    (math.nan, "must be positive and finite"),  # JSON's NaN in a query body
    (math.inf, "must be positive and finite"),
    (True, "expected a duration like 15m, got True"),  # bool is an int; not a duration
    (None, "expected a duration like 15m, got NoneType"),
    ([15], "expected a duration like 15m, got list"),
    ({"m": 1}, "expected a duration like 15m, got dict"),
]


@pytest.mark.parametrize(("value", "message"), REFUSED)
def test_anything_else_is_refused_naming_the_key(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=r"^ask\.timeout: ") as refused:
        parse_duration(value, "ask.timeout")
    assert message in str(refused.value)


def test_the_key_defaults_to_duration() -> None:
    with pytest.raises(ValueError, match=r"^duration: 'soon' is not a duration"):
        parse_duration("soon")
