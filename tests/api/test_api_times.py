"""`since` and `until` as the admin API (`/v1/usage`) and the console's request log take
them: an ISO 8601 time or a duration back from now (pure, table-driven)."""

from __future__ import annotations

import datetime as dt

import pytest

from gateway.api.times import parse_since

NOW = dt.datetime(2026, 11, 22, 12, 0, tzinfo=dt.UTC).timestamp()


def _at(*fields: int, tz: dt.tzinfo = dt.UTC) -> float:
    return dt.datetime(*fields, tzinfo=tz).timestamp()


MOMENTS = [
    ("24h", NOW - 86400),
    ("7d", NOW - 7 * 86400),
    ("90m", NOW - 5400),
    ("1h30m", NOW - 5400),
    ("90", NOW - 90),  # a bare number is seconds back, as every duration
    ("2026-11-22T00:00:00Z", _at(2026, 11, 22)),
    ("2026-11-22T00:00:00+00:00", _at(2026, 11, 22)),
    ("2026-11-22T00:00:00", _at(2026, 11, 22)),  # no offset: UTC, not the host's zone
    ("2026-11-22", _at(2026, 11, 22)),
    ("2026-11-22T02:00:00+02:00", _at(2026, 11, 22)),
    ("2026-11-21T19:00:00-05:00", _at(2026, 11, 22)),
    ("2026-11-22 06:30:15.5Z", _at(2026, 11, 22, 6, 30, 15) + 0.5),
    ("2027-01-01T00:00:00Z", _at(2027, 1, 1)),  # after now: the caller decides
]


@pytest.mark.parametrize(("value", "moment"), MOMENTS)
def test_a_time_or_a_duration_back_is_a_moment(value: str, moment: float) -> None:
    assert parse_since(value, NOW) == pytest.approx(moment)


REFUSED = ["", "yesterday", "-24h", "0s", "24 h", "2026-13-01", "2026-11-22T25:00:00Z",
           "nan", "1e3"]


@pytest.mark.parametrize("value", REFUSED)
def test_anything_else_says_what_to_write(value: str) -> None:
    with pytest.raises(ValueError) as refused:
        parse_since(value, NOW)
    assert str(refused.value) == (f"since {value!r} is neither an ISO 8601 time "
                                  "(2026-11-22T00:00:00Z) nor a duration (24h)")


def test_the_message_quotes_at_most_64_characters() -> None:
    with pytest.raises(ValueError) as refused:
        parse_since("x" * 1000, NOW)
    assert f"'{'x' * 64}'" in str(refused.value)
    assert "x" * 65 not in str(refused.value)
