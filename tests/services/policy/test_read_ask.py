"""The `ask:` reader on its own: a policy's and a rule's `ask:` node in, an `Ask` (or
None) out, every problem with its line."""

from __future__ import annotations

import pytest

from gateway.core.policy.ask_rule import DEFAULT_TIMEOUT, Ask
from gateway.services.policy.read_ask import read_ask
from tests.helpers.policy_yaml import read

POLICY_LOADS = [
    ("{hosts: true}", Ask(hosts=True)),
    ("{requests: true, models: false}", Ask(requests=True)),
    ("{models: true, timeout: 90s}", Ask(models=True, timeout=90, timed=True)),
    ("{hosts: true, timeout: 600}", Ask(hosts=True, timeout=600, timed=True)),
    ("{hosts: true, notify: [ops, slack-1, ops]}", Ask(hosts=True, notify=("ops", "slack-1"))),
]


@pytest.mark.parametrize(("text", "want"), POLICY_LOADS)
def test_a_policy_ask_loads(text: str, want: Ask) -> None:
    assert read(read_ask, text, rule=False) == (want, [])


RULE_LOADS = [
    ("true", Ask()),
    ("false", None),
    ("{}", Ask()),
    ("{timeout: 5s}", Ask(timeout=5, timed=True)),
    ("{notify: [ops]}", Ask(notify=("ops",), timeout=DEFAULT_TIMEOUT)),
]


@pytest.mark.parametrize(("text", "want"), RULE_LOADS)
def test_a_rule_ask_loads(text: str, want: Ask | None) -> None:
    assert read(read_ask, text, rule=True) == (want, [])


REFUSED = [
    (False, "{}", ["1: ask asks for nothing; add hosts, requests and/or models: true"]),
    (False, "{hosts: false}", ["1: ask asks for nothing; add hosts, requests and/or models: "
                               "true"]),
    (False, "true", ["1: ask must be a mapping, e.g. ask: {hosts: true, timeout: 60s}"]),
    (True, "[a]", ["1: ask must be true or {timeout: 60s, notify: [...]}"]),
    (True, "maybe", ["1: ask must be true or false"]),
    (False, "hosts: true\ntimeout: 11m\n",
     ["2: ask.timeout: at most 600s (a request is held that long)"]),
    (False, "hosts: true\ntimeout: soon\n",
     ["2: ask.timeout: 'soon' is not a duration; use e.g. 90s, 15m, 1h30m"]),
    (False, "hosts: yes please\nrequests: 1\n",
     ["1: ask.hosts must be true or false", "2: ask.requests must be true or false"]),
    (False, "hosts: true\nnotify:\n  - ok\n  - no spaces\n",
     ["4: ask.notify: 'no spaces' is not a notifier name (letters, digits, '.', '_', '-')"]),
    (False, "hosts: true\nnotify: ops\n",
     ['2: ask.notify must be a list, e.g. ask.notify: ["..."]']),
]


@pytest.mark.parametrize(("rule", "text", "problems"), REFUSED)
def test_what_is_refused_and_where(rule: bool, text: str, problems: list[str]) -> None:
    assert read(read_ask, text, rule=rule) == (None, problems)


UNKNOWN_KEYS = [
    (False, "{hosts: true, when: always}", Ask(hosts=True),
     ['1: unknown key "when" in ask; known keys: hosts, requests, models, timeout, notify']),
    (True, "{hosts: true}", Ask(), ['1: unknown key "hosts" in ask; known keys: timeout, notify']),
    (True, "{timeot: 5s}", Ask(),
     ['1: unknown key "timeot" in ask (did you mean "timeout"?); known keys: timeout, '
      "notify"]),
]


@pytest.mark.parametrize(("rule", "text", "want", "problems"), UNKNOWN_KEYS)
def test_an_unknown_key_is_reported_and_the_rest_read(rule: bool, text: str, want: Ask,
                                                      problems: list[str]) -> None:
    """(A load with any problem fails: what the reader returned is never used.)"""
    assert read(read_ask, text, rule=rule) == (want, problems)
