"""`ask:` in policy files: what loads, and what is refused with the line and what to
write instead."""

from __future__ import annotations

import pytest

from gateway.core.policy.ask_rule import Ask
from gateway.services.policy import PolicyError, load_policy_text

HEAD = "version: v1\nname: a\n"


@pytest.mark.parametrize(("text", "policy_ask", "rule_ask"), [
    ("ask: {hosts: true}\negress: []\n", Ask(hosts=True), None),
    ("ask: {models: true}\negress: []\n", Ask(models=True), None),
    ("ask: {requests: true, timeout: 2m, notify: [ops, slack-1]}\negress: []\n",
     Ask(requests=True, timeout=120, notify=("ops", "slack-1"), timed=True), None),
    ("egress:\n  - {host: a.test, ask: true}\n", None, Ask()),
    ("egress:\n  - {host: a.test, ask: false}\n", None, None),
    ("egress:\n  - {host: a.test, ask: {timeout: 5s, notify: [ops]}}\n", None,
     Ask(timeout=5, notify=("ops",), timed=True)),
])
def test_what_loads(text: str, policy_ask: Ask | None, rule_ask: Ask | None) -> None:
    policy = load_policy_text("policies/a.yaml", HEAD + text).policies["a"]
    assert policy.ask == policy_ask
    assert [r.ask for r in policy.rules] == ([rule_ask] if policy.rules else [])


@pytest.mark.parametrize(("text", "error"), [
    ("ask: {}\n", "a.yaml:3: ask asks for nothing; add hosts, requests and/or models: true"),
    ("ask: true\n", "a.yaml:3: ask must be a mapping"),
    ("ask: {hosts: yes please}\n", "a.yaml:3: ask.hosts must be true or false"),
    ("ask: {hosts: true, timeout: 11m}\n", "a.yaml:3: ask.timeout: at most 600s"),
    ("ask: {hosts: true, timeout: soon}\n", "a.yaml:3: ask.timeout: 'soon' is not a duration"),
    ("ask: {hosts: true, notify: ['no spaces']}\n", "is not a notifier name"),
    ("ask: {hosts: true, when: always}\n", 'unknown key "when" in ask'),
    ("egress:\n  - {host: a.test, ask: {hosts: true}}\n", 'unknown key "hosts" in ask'),
    ("egress:\n  - {host: a.test, action: deny, ask: true}\n", "ask"),
])
def test_what_is_refused(text: str, error: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy_text("policies/a.yaml", HEAD + text)
    assert any(error in e for e in info.value.errors), info.value.errors
