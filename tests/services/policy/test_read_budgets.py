"""The budgets reader on its own: a policy's `budgets:` node in, `Budget` objects out with
the lines of the credentials they name, every problem with its line. Which credentials
exist and what a policy inherits is checked across files (`build.py`, through the
loader's tests)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.core.policy.model import Budget
from gateway.services.policy.raw import RawBudget
from gateway.services.policy.read_budgets import read_budget, read_budgets
from tests.helpers.policy_yaml import FILE, read

LOADS = [
    ("{name: daily, per: sandbox, window: 24h, tokens: 1000000}",
     Budget(name="daily", per="sandbox", window=86400, window_text="24h", tokens=1_000_000)),
    ("{name: m, per: policy, window: month, cost_usd: 12.5, requests: 3}",
     Budget(name="m", per="policy", window="month", window_text="month", cost_usd=12.5,
            requests=3)),
    ("{name: n, per: sandbox, window: 3600, cost_usd: 2}",
     Budget(name="n", per="sandbox", window=3600, window_text="3600", cost_usd=2.0)),
    ("{name: c, per: sandbox, window: 1m, requests: 1, credentials: [a, b, a], "
     "description: why}",
     Budget(name="c", per="sandbox", window=60, window_text="1m", requests=1,
            credentials=("a", "b"))),
]


@pytest.mark.parametrize(("text", "want"), LOADS)
def test_a_budget_loads(text: str, want: Budget) -> None:
    budget, problems = read(read_budget, text, "team")
    assert problems == []
    assert budget.budget == replace(want, source=f"{FILE}:1", policy="team")
    assert budget.line == 1


def test_the_credentials_a_budget_names_keep_their_lines() -> None:
    text = "- name: a\n  per: sandbox\n  window: 1h\n  requests: 1\n  credentials:\n" \
           "    - openai\n    - anthropic\n"
    (raw,), problems = read(read_budgets, text, "team")
    assert problems == []
    assert isinstance(raw, RawBudget) and raw.line == 1
    assert raw.credentials == (("openai", 6), ("anthropic", 7))


REFUSED = [
    ("{per: sandbox, window: 1h, requests: 1}",
     ["1: budget has no name; add name: <budget name>"]),
    ("{name: 'a b', per: sandbox, window: 1h, requests: 1}",
     ['1: invalid budget name "a b"; use letters, digits, ".", "_", "-"']),
    ("{name: a, window: 1h, requests: 1}",
     ["1: budget has no per; add per: sandbox (each sandbox its own allowance) or per: "
      "policy (one allowance for all its sandboxes)"]),
    ("name: a\nper: team\nwindow: 1h\nrequests: 1\n",
     ["2: invalid per 'team'; use sandbox or policy"]),
    ("{name: a, per: sandbox, requests: 1}",
     ["1: budget has no window; add e.g. window: 24h (or month)"]),
    ("name: a\nper: sandbox\nwindow: fortnight\nrequests: 1\n",
     ["3: window: 'fortnight' is not a duration; use e.g. 90s, 15m, 1h30m, or month"]),
    ("name: a\nper: sandbox\nwindow: 30s\nrequests: 1\n",
     ["3: window '30s' must be whole seconds, at least 1m"]),
    ("name: a\nper: sandbox\nwindow: 90.5\nrequests: 1\n",
     ["3: window '90.5' must be whole seconds, at least 1m"]),
    ("{name: a, per: sandbox, window: 1h}",
     ["1: budget sets no limit; add tokens:, requests: or cost_usd:"]),
    ("name: a\nper: sandbox\nwindow: 1h\ntokens: 1.5\nrequests: 0\ncost_usd: .nan\n",
     ["4: tokens must be a positive whole number, got 1.5",
      "5: requests must be a positive whole number, got 0",
      "6: cost_usd must be a positive number, got nan"]),
    ("name: a\nper: sandbox\nwindow: 1h\nrequests: true\n",
     ["4: requests must be a positive whole number, got True"]),
    ("name: a\nper: sandbox\nwindow: 1h\nrequests: 1\ncredentials: []\n",
     ["5: credentials is empty; list credential names or omit it for every credential of the "
      "policy"]),
    ("name: a\nper: sandbox\nwindow: 1h\nrequests: 1\ncredentials: openai\n",
     ['5: credentials must be a list, e.g. credentials: ["..."]']),
    ("[a]", ["1: a budget must be a mapping (key: value)"]),
]


@pytest.mark.parametrize(("text", "problems"), REFUSED)
def test_what_is_refused_and_where(text: str, problems: list[str]) -> None:
    assert read(read_budget, text, "team") == (None, problems)


SECTIONS = [
    ("~", [], []),
    ("{name: a}", [], ["1: budgets must be a list (- name: ..., per: ..., window: ...)"]),
    ("- {name: a, per: sandbox, window: 1h, requests: 1}\n"
     "- {name: b, per: sandbox, window: 1h}\n"
     "- {name: a, per: policy, window: 2h, requests: 2}\n",
     ["a"], ["2: budget sets no limit; add tokens:, requests: or cost_usd:",
             '3: duplicate budget "a" (first at line 1); budget names must be unique within '
             "a policy"]),
    ("- {name: a, per: sandbox, window: 1h, requests: 1, limit: 3}\n", ["a"],
     ['1: unknown key "limit" in a budget; known keys: name, per, window, tokens, requests, '
      "cost_usd, credentials, description"]),
    ("- {name: a, per: sandbox, window: 1h, request: 1}\n", [],
     ['1: unknown key "request" in a budget (did you mean "requests"?); known keys: name, '
      "per, window, tokens, requests, cost_usd, credentials, description",
      "1: budget sets no limit; add tokens:, requests: or cost_usd:"]),
]


@pytest.mark.parametrize(("text", "names", "problems"), SECTIONS)
def test_the_section(text: str, names: list[str], problems: list[str]) -> None:
    """`budgets:` as a whole: nothing after it (none), not a list, duplicates, unknown
    keys (reported: the load fails) with the rest read."""
    budgets, found = read(read_budgets, text, "team")
    assert ([b.budget.name for b in budgets], found) == (names, problems)
