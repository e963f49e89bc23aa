"""Usage over time: the ledger's per-hour and per-day buckets (`UsageLedger.series`), the
report's `series` and `GET /v1/usage?by=hour|day`, against the rows the same data gives."""

from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from gateway.api.admin import AdminContext, build_admin_app
from gateway.core.metering import Usage
from gateway.core.metering.pricing import Price, Pricing
from gateway.services.identity.signing_keys import SigningKeys
from gateway.services.identity.tokens import TokenService
from gateway.services.metering import Metering
from gateway.services.metering.ledger import DAY, HOUR, UsageLedger
from gateway.services.policy import load_policy_texts
from gateway.services.state.base import MemoryState

NOW = dt.datetime(2026, 11, 22, 10, 30, tzinfo=dt.UTC).timestamp()
H0 = NOW // HOUR * HOUR  # the current hour's start
ADMIN = "admin-token-0123456789abcdef"

# (sandbox, policy, credential, model, input, output, cost, seconds before NOW)
TRAFFIC = [
    ("sb-1", "agent", "openai", "gpt-4o", 100, 10, 0.5, 0),
    ("sb-1", "agent", "openai", "gpt-4o", 200, 20, 0.25, 60),
    ("sb-2", "agent", "anthropic", "claude", 1000, 100, 1.0, 2 * HOUR),
    ("sb-3", "other", "openai", "gpt-4o", 7, 3, None, 2 * HOUR + 5),
    ("sb-1", "agent", "openai", "gpt-4o", 5, 5, 0.125, 11 * HOUR),  # (the day before)
]


def ledger() -> UsageLedger:
    book = UsageLedger(MemoryState(clock=lambda: NOW))
    for sandbox, policy, credential, model, i, o, cost, ago in TRAFFIC:
        book.record(sandbox, policy, credential, model, Usage(model, i, o), cost, NOW - ago)
    return book


def series(book: UsageLedger, **filters: Any) -> list[dict[str, Any]]:
    args: dict[str, Any] = {"sandbox": None, "policy": None, "since": NOW - 12 * HOUR,
                            "now": NOW, **filters}
    return asyncio.run(book.series(**args))


@pytest.mark.parametrize(("filters", "expected"), [
    # (filters, {hours before the current one: (requests, tokens, cost_usd)})
    ({}, {0: (2, 330, 0.75), 2: (2, 1110, 1.0), 11: (1, 10, 0.125)}),
    ({"sandbox": "sb-1"}, {0: (2, 330, 0.75), 11: (1, 10, 0.125)}),
    ({"policy": "other"}, {2: (1, 10, 0.0)}),
    ({"policy": "agent", "sandbox": "sb-3"}, {}),
    ({"since": NOW - HOUR}, {0: (2, 330, 0.75)}),
])
def test_hourly_buckets(filters: dict[str, Any],
                              expected: dict[int, tuple[int, int, float]]) -> None:
    found = series(ledger(), **filters)
    first = (filters.get("since", NOW - 12 * HOUR)) // HOUR * HOUR
    assert [b["start"] for b in found] == [
        first + i * HOUR for i in range(int((H0 - first) // HOUR) + 1)]  # empty ones too
    got = {int((H0 - b["start"]) // HOUR): (b["requests"], b["tokens"], b["cost_usd"])
           for b in found if b["requests"]}
    assert got == expected  # (costs are exact binary fractions)


def test_buckets_add_up_to_the_rows() -> None:
    book = ledger()
    rows, found = asyncio.run(book.summary(sandbox=None, policy=None,
                                           since=NOW - 12 * HOUR, now=NOW, step=HOUR))
    assert rows == asyncio.run(book.query(sandbox=None, policy=None, since=NOW - 12 * HOUR,
                                          now=NOW))
    for column in ("requests", "input_tokens", "output_tokens", "cost_usd"):
        assert sum(b[column] for b in found) == pytest.approx(sum(r[column] for r in rows))
    assert all(b["tokens"] == b["input_tokens"] + b["output_tokens"] for b in found)


def test_daily_buckets_start_at_midnight_utc() -> None:
    found = series(ledger(), since=NOW - 3 * DAY, step=DAY)
    day = NOW // DAY * DAY
    assert [b["start"] for b in found] == [day - 3 * DAY, day - 2 * DAY, day - DAY, day]
    assert [b["requests"] for b in found] == [0, 0, 1, 4]


def test_series_is_clamped_to_the_retention() -> None:
    book = UsageLedger(MemoryState(clock=lambda: NOW), retention=3 * HOUR)
    found = series(book, since=NOW - 30 * DAY)
    assert len(found) == 4 and found[-1]["start"] == H0


def test_a_step_that_is_neither_hour_nor_day_is_refused() -> None:
    with pytest.raises(ValueError, match="step"):
        series(ledger(), step=600)


def _client(tmp_path: Path, pricing: Pricing | None) -> TestClient:
    state = MemoryState(clock=lambda: NOW)
    metering = Metering(state, pricing=pricing)
    for sandbox, policy, credential, model, i, o, cost, ago in TRAFFIC:
        metering.ledger.record(sandbox, policy, credential, model, Usage(model, i, o), cost,
                               NOW - ago)
    policies = load_policy_texts({"a.yaml": "version: v1\nname: agent\negress: []\n"})
    tokens = TokenService(SigningKeys.load(tmp_path / "keys"), state, lambda name: [])
    return TestClient(build_admin_app(AdminContext(
        admin_token=ADMIN, tokens=tokens, policies=lambda: policies, readiness=_Ready(),
        metering=metering, clock=lambda: NOW)))


class _Ready:
    def ready(self) -> tuple[bool, str]:
        return True, "ready"

    def degraded(self) -> list[str]:
        return []


def test_usage_endpoint_by_hour(tmp_path: Path) -> None:
    client = _client(tmp_path, Pricing({"*": Price(1, 1, 1)}))
    auth = {"Authorization": f"Bearer {ADMIN}"}
    plain = client.get("/v1/usage?since=3h", headers=auth).json()
    assert "series" not in plain and "by" not in plain  # (unchanged without by)
    hourly = client.get("/v1/usage?since=3h&by=hour&sandbox=sb-2", headers=auth).json()
    assert hourly["by"] == "hour"
    assert [b["start"] for b in hourly["series"]] == [
        "2026-11-22T07:00:00Z", "2026-11-22T08:00:00Z", "2026-11-22T09:00:00Z",
        "2026-11-22T10:00:00Z"]
    assert [b["tokens"] for b in hourly["series"]] == [0, 1100, 0, 0]
    assert hourly["series"][1]["cost_usd"] == 1.0
    daily = client.get("/v1/usage?since=2d&by=day", headers=auth).json()
    assert [(b["start"], b["requests"]) for b in daily["series"]] == [
        ("2026-11-20T00:00:00Z", 0), ("2026-11-21T00:00:00Z", 1),
        ("2026-11-22T00:00:00Z", 4)]
    bad = client.get("/v1/usage?by=minute", headers=auth)
    assert bad.status_code == 400 and "not hour or day" in bad.json()["reason"]


def test_usage_series_without_pricing_has_no_cost(tmp_path: Path) -> None:
    auth = {"Authorization": f"Bearer {ADMIN}"}
    answer = _client(tmp_path, None).get("/v1/usage?since=1h&by=hour", headers=auth).json()
    assert [b["cost_usd"] for b in answer["series"]] == [None, None]
