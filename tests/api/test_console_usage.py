"""The console's usage page (`/console/usage`) over a real Metering on the memory store:
filters, totals, the server-drawn chart and its table, rows, budgets with used, limit
and reset, metering off (503), no token in the page, and its render time."""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.console import assert_no_secrets, console, sign_in
from starlette.testclient import TestClient

from gateway.core.metering import Usage
from gateway.core.metering.pricing import Price, Pricing
from gateway.core.policy import PolicySet
from gateway.services.metering import Metering
from gateway.services.metering.budgets import NANO, Hold
from gateway.services.policy import load_policy_texts
from gateway.services.state.base import MemoryState

NOW = dt.datetime(2026, 11, 22, 10, 30, tzinfo=dt.UTC).timestamp()
POLICY = """\
version: v1
name: agent
egress:
  - host: api.openai.com
    credential: openai
credentials:
  openai: {preset: openai, secret: k1}
budgets:
  - {name: daily, per: policy, window: 24h, tokens: 1000}
  - {name: each, per: sandbox, window: 1h, requests: 2}
"""
OTHER = "version: v1\nname: other\negress: []\n"


def policies() -> PolicySet:
    return load_policy_texts({"agent.yaml": POLICY, "other.yaml": OTHER})


def used(metering: Metering, current: PolicySet, sandbox: str, model: str,
         tokens: tuple[int, int], at: float) -> None:
    """An exchange as `Metering.admit` and `complete` count it: admitted against the
    budgets, settled to its usage, added to the ledger."""
    usage = Usage(model, *tokens)
    cost = metering.budgets.cost(usage)
    hold = metering.budgets.admit(sandbox, current.policies["agent"], "openai", at)
    assert isinstance(hold, Hold)
    metering.budgets.settle(hold, usage.tokens, round((cost or 0) * NANO))
    metering.ledger.record(sandbox, "agent", "openai", model, usage, cost, at)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    state = MemoryState(clock=lambda: NOW)
    metering = Metering(state, pricing=Pricing({"gpt-4o*": Price(2.5, 10, 1.25)}))
    current = policies()
    used(metering, current, "sb-1", "gpt-4o", (300, 100), NOW - 60)
    used(metering, current, "sb-1", "gpt-4o", (200, 50), NOW - 3 * 3600)
    used(metering, current, "sb-2", "gpt-4o-mini", (400, 150), NOW - 2 * 86400)
    app, _ = console(state, current, tmp_path / "keys", lambda: NOW, metering=metering)
    with app:
        sign_in(app)
        yield app


def cells(html: str, first: str) -> list[str]:
    """The cells of the table row whose first cell is `first`."""
    row = re.search(rf"<tr><td>{re.escape(first)}</td>(.*?)</tr>", html, re.S)
    assert row, html
    return re.findall(r"<td>(.*?)</td>", row.group(1))


def test_the_usage_page(client: TestClient) -> None:
    page = client.get("/console/usage")
    assert page.status_code == 200
    html = page.text
    assert_no_secrets(html)
    assert " style=" not in html and "<script" not in html
    assert page.headers["content-security-policy"].startswith("default-src 'none'")
    assert 'aria-current="page">Usage<' in html
    assert "From 2026-11-21T10:00:00Z to 2026-11-22T10:30:00Z" in html  # (24h by default)
    # totals of the last 24 hours: two calls of sb-1
    assert re.search(r"<dt>Requests</dt><dd>2</dd>", html)
    assert re.search(r"<dt>Input tokens</dt><dd>500</dd>", html)
    assert "<dt>Cost</dt><dd>$0.0027</dd>" in html  # 500 x 2.5 + 150 x 10 per million
    # the charts: an accessible SVG per measure, a title per hour with use
    assert html.count('role="img"') == 2
    assert 'aria-label="Tokens per hour"' in html and 'aria-label="Cost per hour (USD)"' in html
    assert "2026-11-22 10:00Z: 300 input, 100 output tokens, 1 requests" in html
    assert "2026-11-22 07:00Z: 200 input, 50 output tokens, 1 requests" in html
    assert "The charts' numbers (2 hours with use)" in html
    assert "<td>2026-11-22T07:00:00Z</td><td>1</td><td>200</td><td>50</td>" in html
    assert cells(html, "agent")[:6] == ["sb-1", "openai", "gpt-4o", "2", "0", "500"]
    # the policy's budget: used of limit, its window and reset; per-sandbox ones need one
    assert "tokens: 650 of 1,000" in html
    assert '<meter min="0" max="1000" value="650"' in html
    assert "24h from 2026-11-22T00:00:00Z" in html and "<td>2026-11-23T00:00:00Z</td>" in html
    assert "within" in html and "exceeded" not in html
    assert "Per-sandbox budgets show when you choose a sandbox." in html


def test_filters_narrow_the_page(client: TestClient) -> None:
    week = client.get("/console/usage?since=7d&sandbox=sb-2").text
    assert "From 2026-11-15T10:00:00Z" in week
    assert 'aria-label="Tokens per hour"' in week  # (7 days: still per hour)
    assert re.search(r"<dt>Input tokens</dt><dd>400</dd>", week)
    assert cells(week, "agent")[:3] == ["sb-2", "openai", "gpt-4o-mini"]
    assert 'value="sb-2"' in week and '<option value="7d" selected>' in week
    # a sandbox shows its own budgets: sb-1 used both its requests of the hour
    one = client.get("/console/usage?sandbox=sb-1&since=1h").text
    assert "requests: 1 of 2" in one and "sandbox sb-1" in one
    assert client.get("/console/usage?policy=other").text.count("No use in this span") == 2
    # a span that is no duration, or a policy that does not exist: no filter
    odd = client.get("/console/usage?since=forever&policy=nope")
    assert odd.status_code == 200 and "From 2026-11-21T10:00:00Z" in odd.text
    month = client.get("/console/usage?since=30d").text  # (beyond the 7-day retention)
    assert "From 2026-11-15T10:00:00Z" in month


def test_an_exceeded_budget_is_flagged(tmp_path: Path) -> None:
    state = MemoryState(clock=lambda: NOW)
    metering = Metering(state)
    current = policies()
    used(metering, current, "sb-1", "gpt-4o", (900, 200), NOW - 60)
    app, _ = console(state, current, tmp_path / "keys", lambda: NOW, metering=metering)
    with app:
        sign_in(app)
        html = app.get("/console/usage").text
    assert '<tr class="exceeded">' in html and "<strong>exceeded</strong>" in html
    assert "tokens: 1,100 of 1,000" in html
    assert "No cost chart: metering.pricing is not configured." in html
    assert html.count('role="img"') == 1


def test_metering_off_is_a_problem_page(tmp_path: Path) -> None:
    app, _ = console(MemoryState(), policies(), tmp_path / "keys", time.time)
    with app:
        assert app.get("/console/usage").headers["location"] == "/console/login"
        sign_in(app)
        page = app.get("/console/usage")
    assert page.status_code == 503
    assert "Metering is not enabled in this gateway process" in page.text
    assert 'role="alert"' in page.text


def test_a_busy_week_renders_fast(tmp_path: Path) -> None:
    """7 days of hourly use by 40 sandboxes with 3 models each (120 rows, 20,160
    sandbox-hours): the page renders well within the 100 ms budget."""
    state = MemoryState(clock=lambda: NOW)
    metering = Metering(state, pricing=Pricing({"*": Price(1, 2, 0.5)}))
    for hour in range(7 * 24):
        for sandbox in range(40):
            for model in ("m-a", "m-b", "m-c"):
                metering.ledger.record(f"sb-{sandbox}", "agent", "openai", model,
                                       Usage(model, 100, 10), 0.001, NOW - hour * 3600)
    app, _ = console(state, policies(), tmp_path / "keys", lambda: NOW, metering=metering)
    with app:
        sign_in(app)
        timings = []
        for _ in range(3):
            started = time.perf_counter()
            page = app.get("/console/usage?since=7d")
            timings.append(time.perf_counter() - started)
    assert page.status_code == 200 and page.text.count("<tr><td>agent</td>") == 120
    print(f"render: {min(timings) * 1000:.0f} ms")
    assert min(timings) < 0.25, timings  # (100 ms on an idle machine; CI is shared)
