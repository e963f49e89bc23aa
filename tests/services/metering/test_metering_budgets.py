"""Budgets over fixed windows (test clock), and operator pricing."""

from __future__ import annotations

import datetime as dt
import textwrap
from pathlib import Path

import pytest
from helpers.clock import Clock, run

from gateway.core.metering.pricing import Price, Pricing, PricingError, parse_pricing
from gateway.core.metering.usage import Usage
from gateway.core.policy import PolicySet
from gateway.services.metering.budgets import (
    RETRY_AFTER_MAX,
    BudgetBook,
    Hold,
    Reservation,
    budget_problems,
    window_bounds,
)
from gateway.services.metering.pricing import load_pricing
from gateway.services.policy import load_policy_text
from gateway.services.state.leases import ORPHANS, parse_held
from gateway.services.state.memory_counters import MemoryCounters


def ts(text: str) -> float:
    return dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC).timestamp()


def iso(value: float) -> str:
    return dt.datetime.fromtimestamp(value, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")


@pytest.mark.parametrize(("window", "now", "start", "end"), [
    (86400, "2026-11-22T10:17:03", "2026-11-22T00:00:00", "2026-11-23T00:00:00"),
    (86400, "2026-11-22T00:00:00", "2026-11-22T00:00:00", "2026-11-23T00:00:00"),
    (86400, "2026-11-22T23:59:59", "2026-11-22T00:00:00", "2026-11-23T00:00:00"),
    (3600, "2026-11-22T10:17:03", "2026-11-22T10:00:00", "2026-11-22T11:00:00"),
    (2 * 86400, "2026-11-22T10:00:00", "2026-11-21T00:00:00", "2026-11-23T00:00:00"),
    (5 * 3600, "1970-01-01T07:00:00", "1970-01-01T05:00:00", "1970-01-01T10:00:00"),
    ("month", "2026-11-22T10:17:03", "2026-11-01T00:00:00", "2026-12-01T00:00:00"),
    ("month", "2026-12-31T23:59:59", "2026-12-01T00:00:00", "2027-01-01T00:00:00"),
    ("month", "2028-02-29T12:00:00", "2028-02-01T00:00:00", "2028-03-01T00:00:00"),
])
def test_window_bounds(window: int | str, now: str, start: str, end: str) -> None:
    got = window_bounds(window, ts(now))  # type: ignore[arg-type]
    assert (iso(got[0]), iso(got[1])) == (start, end)


POLICIES = """\
version: v1
name: agent
extends: [base]
egress:
  - {host: api.openai.com, credential: openai}
  - {host: api.anthropic.com, credential: anthropic}
budgets:
  - {name: daily, per: sandbox, window: 24h, tokens: 1000, credentials: [openai]}
  - {name: team, per: policy, window: 1h, requests: 5}
credentials:
  openai: {preset: openai, secret: k1}
  anthropic: {preset: anthropic, secret: k2}
---
version: v1
name: base
egress:
  - {host: api.openai.com, credential: openai}
budgets:
  - {name: spend, per: sandbox, window: month, cost_usd: 0.01}
---
version: v1
name: other
extends: [base]
egress: []
"""


@pytest.fixture
def policies() -> PolicySet:
    return load_policy_text("b.yaml", POLICIES)


@pytest.fixture
def clock() -> Clock:
    c = Clock()
    c.now = ts("2026-11-22T10:00:00")
    return c


PRICING = Pricing({"gpt-4o-mini*": Price(0.15, 0.60, 0.075), "*": Price(1.0, 2.0, 0.5)})


def book(clock: Clock, pricing: Pricing | None = PRICING) -> BudgetBook:
    return BudgetBook(MemoryCounters(clock), pricing)


def test_tokens_budget_per_sandbox_and_reset(policies: PolicySet, clock: Clock) -> None:
    agent = policies.policies["agent"]
    b = book(clock)
    use = Usage("gpt-4o-mini", 600, 300)
    assert b.check("sb-1", agent, "openai", clock.now) is None
    b.record("sb-1", agent, "openai", use, clock.now)
    assert b.check("sb-1", agent, "openai", clock.now) is None  # 900 < 1000
    b.record("sb-1", agent, "openai", use, clock.now)  # the crossing request completes
    clock.now += 3 * 3600 + 25
    refused = b.check("sb-1", agent, "openai", clock.now)
    assert refused is not None
    assert (refused.budget.name, refused.kind, refused.used, refused.limit) == (
        "daily", "tokens", 1800, 1000)
    assert (refused.status, refused.code, refused.rule) == (429, "budget_exceeded", "b.yaml:8")
    assert iso(refused.resets_at) == "2026-11-23T00:00:00"
    assert refused.frees_in == 24 * 3600 - (3 * 3600 + 25) - 10 * 3600
    assert refused.retry_after is None  # hours away: final for now, no Retry-After
    assert refused.reason == (
        'budget "daily" (b.yaml:8) is used up for sandbox "sb-1": 1,800 tokens used of '
        "1,000 tokens in the 24h window from 2026-11-22T00:00:00Z; it resets at "
        "2026-11-23T00:00:00Z (in 10h59m35s); retry then, or ask an operator to raise the "
        "budget")
    # Another sandbox, and another credential the budget does not cover, are unaffected.
    assert b.check("sb-2", agent, "openai", clock.now) is None
    assert b.check("sb-1", agent, "anthropic", clock.now) is None
    # The next window starts from zero.
    clock.now = ts("2026-11-23T00:00:00")
    assert b.check("sb-1", agent, "openai", clock.now) is None


def test_requests_budget_per_policy(policies: PolicySet, clock: Clock) -> None:
    agent = policies.policies["agent"]
    b = book(clock)
    for i in range(5):
        assert b.check(f"sb-{i}", agent, "anthropic", clock.now) is None
        b.admit(f"sb-{i}", agent, "anthropic", clock.now)
        b.record(f"sb-{i}", agent, "anthropic", Usage(None), clock.now)  # unknown tokens
    refused = b.check("sb-new", agent, "anthropic", clock.now)
    assert refused is not None and refused.budget.name == "team"
    assert refused.subject == "agent" and refused.used == 5
    assert 'for policy "agent" (all its sandboxes): 5 requests used of 5 requests' in (
        refused.reason)
    clock.now += 3600
    assert b.check("sb-new", agent, "anthropic", clock.now) is None


def test_cost_budget_and_inheritance(policies: PolicySet, clock: Clock) -> None:
    agent, other = policies.policies["agent"], policies.policies["other"]
    b = book(clock)
    # gpt-4o-mini: (1000-200) x 0.15 + 200 x 0.075 + 10000 x 0.60 per million = 0.006135
    use = Usage("gpt-4o-mini-2024-07-18", 1000, 10000, 200)
    assert b.cost(use) == pytest.approx(0.006135)
    b.record("sb", other, "openai", use, clock.now)
    assert b.check("sb", other, "openai", clock.now) is None
    b.record("sb", other, "openai", use, clock.now)
    refused = b.check("sb", other, "openai", clock.now)
    assert refused is not None and refused.budget.name == "spend"
    assert refused.used == pytest.approx(0.01227)
    assert "$0.01 used of $0.01" in refused.reason
    assert iso(refused.resets_at) == "2026-12-01T00:00:00"
    # The inherited budget is a separate allowance in each policy that has it.
    assert b.check("sb", agent, "openai", clock.now) is None


def test_refusal_names_the_budget_that_resets_last(policies: PolicySet, clock: Clock) -> None:
    agent = policies.policies["agent"]
    b = book(clock)
    for _ in range(5):
        b.record("sb", agent, "openai", Usage("gpt-4o-mini", 5000, 5000), clock.now)
    refused = b.check("sb", agent, "openai", clock.now)
    assert refused is not None
    # daily (tokens), team (requests) and spend (cost) are all used up: spend resets last.
    assert refused.budget.name == "spend"


def test_no_pricing_counts_no_cost(policies: PolicySet, clock: Clock) -> None:
    other = policies.policies["other"]
    b = book(clock, pricing=None)
    for _ in range(10):
        b.record("sb", other, "openai", Usage("gpt-4o", 10**6, 10**6), clock.now)
    assert b.check("sb", other, "openai", clock.now) is None
    assert budget_problems(list(policies.policies.values()), None) == [
        'b.yaml:19: budget "spend" sets cost_usd but metering.pricing is not configured, so '
        "costs are unknown and every inference call it counts is refused "
        "(metering_unavailable); set metering.pricing in the gateway config"]
    assert budget_problems(list(policies.policies.values()), PRICING) == []


def test_unpriced_model_counts_zero(policies: PolicySet, clock: Clock) -> None:
    other = policies.policies["other"]
    b = book(clock, Pricing({"gpt-4o-mini*": Price(1, 1, 1)}))
    assert b.cost(Usage("claude-x", 10, 10)) is None
    b.record("sb", other, "openai", Usage("claude-x", 10**9, 10**9), clock.now)
    assert b.check("sb", other, "openai", clock.now) is None


def test_status(policies: PolicySet, clock: Clock) -> None:
    agent = policies.policies["agent"]
    b = book(clock)
    b.admit("sb", agent, "openai", clock.now)
    b.record("sb", agent, "openai", Usage("gpt-4o-mini", 700, 400), clock.now)
    status = {s["budget"]: s for s in run(b.status(agent, "sb", clock.now))}
    assert status["daily"]["used"] == {"tokens": 1100, "requests": 1,
                                       "cost_usd": pytest.approx(0.000345)}
    assert status["daily"]["exceeded"] is True
    assert status["daily"]["limits"] == {"tokens": 1000}
    assert status["daily"]["resets_at"] == "2026-11-23T00:00:00Z"
    assert status["team"]["subject"] == "agent" and status["team"]["exceeded"] is False
    # Without a sandbox only policy-wide budgets have a subject to report.
    assert [s["budget"] for s in run(b.status(agent, None, clock.now))] == ["team"]


# --- pricing ------------------------------------------------------------------------------


def test_pricing_file(tmp_path: Path) -> None:
    path = tmp_path / "pricing.yaml"
    path.write_text(textwrap.dedent("""\
        gpt-4o-mini*: {input: 0.15, output: 0.60, cached_input: 0.075}
        gpt-4o*: {input: 2.5, output: 10}
        "*": {input: 1, output: 1}
    """))
    pricing = load_pricing(path)
    assert pricing.price("gpt-4o-mini-2024-07-18") == Price(0.15, 0.6, 0.075)
    assert pricing.price("gpt-4o-2024-08-06") == Price(2.5, 10.0, 2.5)  # cached = input
    assert pricing.price("GPT-4O") == Price(1.0, 1.0, 1.0)  # case-sensitive: catch-all
    assert pricing.price(None) is None
    assert pricing.cost(Usage("gpt-4o", 1_000_000, 1_000_000, 500_000)) == pytest.approx(12.5)
    assert pricing.cost(Usage("gpt-4o")) is None  # unknown counts: no cost


@pytest.mark.parametrize(("text", "message"), [
    ("[1, 2]", "expected a map of model glob"),
    ("gpt: 3", "'gpt': expected {input: N, output: N, cached_input: N}"),
    ("gpt: {input: 1}", "'gpt': input and output prices are required"),
    ("gpt: {input: 1, output: -1}", "'gpt'.output: expected a non-negative number"),
    ("gpt: {input: 1, output: 1, cache: 1}", "'gpt': unknown key 'cache'"),
    ("gpt: {input: yes, output: 1}", "'gpt'.input: expected a non-negative number"),
    ("gpt: [", "not valid YAML"),
])
def test_pricing_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(PricingError, match=message.replace("[", r"\[").replace("{", r"\{")):
        load_pricing(path)


def test_pricing_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PricingError, match="cannot read"):
        load_pricing(tmp_path / "nope.yaml")
    assert parse_pricing(None).prices == {}



def test_requests_count_when_admitted(policies: PolicySet, clock: Clock) -> None:
    """A burst of parallel calls meets a `requests` limit at admission, before any of
    them completes; tokens count only on completion."""
    agent = policies.policies["agent"]
    b = book(clock)
    for i in range(5):  # "team": 5 requests per hour for the whole policy, none completed
        assert b.check(f"sb-{i}", agent, "anthropic", clock.now) is None
        b.admit(f"sb-{i}", agent, "anthropic", clock.now)
    refused = b.check("sb-9", agent, "anthropic", clock.now)
    assert refused is not None and (refused.budget.name, refused.used) == ("team", 5)
    b.record("sb-1", agent, "anthropic", Usage("claude", 10, 10), clock.now)
    refused = b.check("sb-9", agent, "anthropic", clock.now)
    assert refused is not None and refused.used == 5  # completion does not count it again


@pytest.mark.parametrize(("recorded", "session", "refused_kind"), [
    (0, Usage("m", 400, 100), None),  # 500 of 1,000 tokens
    (600, Usage("m", 300, 99), None),  # 999
    (600, Usage("m", 300, 100), "tokens"),  # 1,000: used up
    (1200, Usage("m"), "tokens"),  # recorded before: still used up
    (0, Usage("m", 990, 10), "tokens"),  # the session alone
])
def test_an_open_session_counts_its_usage_so_far(
        policies: PolicySet, clock: Clock, recorded: int, session: Usage,
        refused_kind: str | None) -> None:
    """A Realtime session still open: its responses so far count on top of what was
    recorded, and `requests` limits do not apply (the session was counted at admission:
    the 5th of 5 requests may go on)."""
    agent = policies.policies["agent"]
    b = book(clock)
    for i in range(5):
        b.admit(f"sb-{i}", agent, "openai", clock.now)  # the "team" budget: 5 of 5
    if recorded:
        b.record("sb-1", agent, "openai", Usage("m", recorded, 0), clock.now)
    assert b.check("sb-1", agent, "openai", clock.now) is not None  # a new request: no
    refused = b.check("sb-1", agent, "openai", clock.now, open_session=session)
    assert (refused.kind if refused else None) == refused_kind
    if refused is not None:
        assert refused.budget.name == "daily" and refused.used == recorded + session.tokens


@pytest.mark.parametrize(("at", "frees_in", "retry_after"), [
    ("10:55:00", 300, 300),  # the 1h window ends within RETRY_AFTER_MAX: worth waiting
    ("10:59:59", 1, 1),
    ("10:54:59", 301, None),  # past it: final for now (the provider's quota answer)
    ("10:00:01", 3599, None),
])
def test_retry_after_only_where_waiting_helps(policies: PolicySet, clock: Clock, at: str,
                                              frees_in: int, retry_after: int | None) -> None:
    agent = policies.policies["agent"]
    b = book(clock)
    for _ in range(5):  # the team's 5 requests an hour
        assert b.admit("sb-1", agent, "anthropic", clock.now) is not None
    refused = b.check("sb-1", agent, "anthropic", ts(f"2026-11-22T{at}"))
    assert refused is not None and (refused.budget.name, refused.kind) == ("team", "requests")
    assert (refused.frees_in, refused.retry_after) == (frees_in, retry_after)
    assert RETRY_AFTER_MAX == 300


# --- reservations -----------------------------------------------------------------------


def test_a_parallel_burst_cannot_overshoot_a_token_budget(policies: PolicySet,
                                                          clock: Clock) -> None:
    """Ten calls admitted at once, each reserving 300 of a 1,000-token budget: three
    fit (900 held), the fourth is refused while they run, not after they ended."""
    agent = policies.policies["agent"]
    b = book(clock)
    reserve = Reservation(300)
    holds = []
    for _ in range(10):
        refused = b.check("sb-1", agent, "openai", clock.now, reserve=reserve)
        if refused is None:
            holds.append(b.admit("sb-1", agent, "openai", clock.now, reserve))
    assert len(holds) == 3
    refused = b.check("sb-1", agent, "openai", clock.now, reserve=reserve)
    assert refused is not None and (refused.used, refused.held, refused.asked) == (0, 900, 300)
    assert refused.retry_after == refused.frees_in == 5  # room again once calls settle
    assert refused.reason.startswith('budget "daily" (b.yaml:8) has 100 tokens left for '
                                     'sandbox "sb-1" (900 tokens more are held by calls '
                                     "still running), and this call may use up to 300 tokens")
    # They end: each settles to what it used (two read theirs, one never did).
    hold0, hold1, hold2 = holds
    assert hold0 is not None and hold1 is not None and hold2 is not None
    b.settle(hold0, 120, 0)
    b.settle(hold1, 80, 0)
    b.settle(hold2, 300, 0)  # (the engine passes the reservation when usage never came)
    status = {s["budget"]: s for s in run(b.status(agent, "sb-1", clock.now))}
    assert status["daily"]["settled"]["tokens"] == 500
    assert status["daily"]["reserved"] == {"tokens": 0, "cost_usd": 0.0}
    assert b.check("sb-1", agent, "openai", clock.now, reserve=reserve) is None
    assert b.check("sb-1", agent, "openai", clock.now, reserve=Reservation(501)) is not None


def test_a_call_larger_than_the_budget_is_refused_before_anything_is_used(
        policies: PolicySet, clock: Clock) -> None:
    agent = policies.policies["agent"]
    refused = book(clock).check("sb-1", agent, "openai", clock.now,
                                reserve=Reservation(1001))
    assert refused is not None and refused.frees_in == 14 * 3600  # not held: the window
    assert refused.retry_after is None
    assert "has 1,000 tokens left" in refused.reason and "lower max_tokens" in refused.reason


def test_reservations_show_in_status_and_hold_the_window_they_started_in(
        policies: PolicySet, clock: Clock) -> None:
    agent = policies.policies["agent"]
    b = book(clock)
    hold = b.admit("sb", agent, "openai", clock.now, Reservation(400, 7))
    status = {s["budget"]: s for s in run(b.status(agent, "sb", clock.now))}
    assert status["daily"]["reserved"] == {"tokens": 400, "cost_usd": 7e-9}
    assert status["daily"]["exceeded"] is False
    clock.now = ts("2026-11-23T00:00:01")  # it ends in the next window: settled in its own
    assert hold is not None
    b.settle(hold, 250, 0)
    assert run(b.status(agent, "sb", clock.now))[0]["used"]["tokens"] == 0
    assert run(b.status(agent, "sb", clock.now - 2))[0]["used"]["tokens"] == 250


def test_cost_reservations_need_prices(policies: PolicySet, clock: Clock) -> None:
    base = policies.policies["base"]  # spend: cost_usd 0.01
    assert book(clock).reservation(base, "openai", "gpt-4o-mini", 1000, 1000) == \
        Reservation(2000, round((1000 * 0.15 + 1000 * 0.60) / 1e6 * 1e9))
    unpriced = book(clock, Pricing({"gpt-4o*": Price(1, 1, 1)})).reservation(
        base, "openai", "claude-x", 10, 10)
    assert isinstance(unpriced, str) and 'model "claude-x" has no price' in unpriced
    none = book(clock, None).reservation(base, "openai", "gpt-4o-mini", 10, 10)
    assert isinstance(none, str) and "metering.pricing is not configured" in none
    # A budget with no cost limit needs no price.
    tokens_only = load_policy_text("t.yaml", """\
version: v1
name: t
egress:
  - {host: api.openai.com, credential: openai}
budgets:
  - {name: daily, per: sandbox, window: 24h, tokens: 100}
credentials:
  openai: {preset: openai, secret: k1}
""").policies["t"]
    assert book(clock, None).reservation(tokens_only, "openai", None, 5, 6) == Reservation(11)


def test_a_reservation_is_recorded_under_the_lease_and_released_with_its_settlement(
        policies: PolicySet, clock: Clock) -> None:
    """Admission records the reservation under the process's lease, in every window it
    counts in; the settlement takes the record back with the reservation (one write);
    with no lease (a tool, `policy test`) nothing is recorded."""
    async def scenario() -> None:
        agent = policies.policies["agent"]
        counters = MemoryCounters(clock)
        unleased = BudgetBook(counters, PRICING).admit("sb", agent, "openai", clock.now,
                                                       Reservation(400))
        assert isinstance(unleased, Hold) and unleased.holder is None
        assert ORPHANS not in counters.view.shared
        BudgetBook(counters, PRICING).settle(unleased, 0, 0)
        await counters.take_lease("host|proxy|0", beat=3600)
        holder = counters.holder
        b = BudgetBook(counters, PRICING)
        hold = b.admit("sb", agent, "openai", clock.now, Reservation(400, 9))
        assert isinstance(hold, Hold) and hold.holder == holder is not None
        records = counters.view.shared[ORPHANS]
        assert sorted((parse_held(k), v) for k, v in records.items()) == sorted(
            [((holder, table, "rt:" + subject), 400) for table, subject, _ in hold.places]
            + [((holder, table, "rc:" + subject), 9) for table, subject, _ in hold.places])
        b.settle(hold, 250, 0)
        assert set(records.values()) == {0}
        status = {s["budget"]: s for s in await b.status(agent, "sb", clock.now)}
        assert status["daily"]["used"]["tokens"] == 250
        assert status["daily"]["reserved"] == {"tokens": 0, "cost_usd": 0.0}
        await counters.close()
        assert counters.leases == {}  # (given back)

    run(scenario())
