"""The reader of a policy's own keys on its own: `version`, `name`, `description`, `mode`
(the `RawPolicy` the section readers fill), `extends`, `tokens`, `subjects` and
`telemetry`, every problem with its line."""

from __future__ import annotations

import pytest
import yaml
from yaml.nodes import Node

from gateway.core.policy.model import Mode, Subject
from gateway.services.policy.loader import load_policy_text
from gateway.services.policy.nodes import Nodes
from gateway.services.policy.raw import RawPolicy
from gateway.services.policy.read_policy import (
    POLICY_KEYS,
    read_extends,
    read_policy,
    read_subjects,
    read_telemetry,
    read_tokens,
)
from tests.helpers.policy_yaml import FILE, read


def policy(nodes: Nodes, node: Node) -> RawPolicy | None:
    keys = nodes.mapping(node, POLICY_KEYS, "a policy")
    return None if keys is None else read_policy(nodes, node, keys)


HEADS = [
    ("version: v1\nname: team\n", "team", "enforce", []),
    ("version: v1\nname: a.b_c-9\nmode: report\ndescription: why\n", "a.b_c-9", "report", []),
    ("version: v1\nname: team\nmode: enforce\n", "team", "enforce", []),
    ("version: v2\nname: team\n", "team", "enforce",
     ["1: unsupported version 'v2'; use version: v1"]),
    ("version: 1\nname: team\n", "team", "enforce",
     ["1: unsupported version 1; use version: v1"]),
    ("name: team\n", "team", "enforce", ["1: missing version; add version: v1"]),
    ("version: v1\nmode: strict\n", None, "enforce",
     ["1: missing name; add name: <policy name>",
      "2: invalid mode 'strict'; use enforce, report or learn"]),
    ("version: v1\nname: a b\n", None, "enforce",
     ['2: invalid policy name "a b"; use letters, digits, ".", "_", "-"']),
    ("version: v1\nname: agent/x\n", None, "enforce",
     ['2: invalid policy name "agent/x"; use letters, digits, ".", "_", "-"']),
    ("version: v1\nname: []\n", None, "enforce", ["2: name must be a non-empty string"]),
    ("version: v1\nname: team\ndescription: 5\n", "team", "enforce",
     ["3: description must be a non-empty string"]),
    ("version: v1\nname: team\negres: []\n", "team", "enforce",
     ['3: unknown key "egres" in a policy (did you mean "egress"?); known keys: version, '
      "name, description, mode, extends, egress, credentials, budgets, tokens, subjects, "
      "ask, dlp, telemetry"]),
    ("version: v1\nname: a\nname: b\n", "a", "enforce",
     ['3: duplicate key "name" (first at line 2)']),
]


@pytest.mark.parametrize(("text", "name", "mode", "problems"), HEADS)
def test_the_policy_head(text: str, name: str | None, mode: Mode, problems: list[str]) -> None:
    raw, found = read(policy, text)
    assert found == problems
    assert (raw.name, raw.named, raw.mode) == (name or f"<unnamed policy at {FILE}:1>",
                                               name is not None, mode)
    assert (raw.file, raw.line, raw.given_name) == (FILE, 1, name or "")


def test_a_shipped_preset_may_be_named_agent_slash() -> None:
    raw, problems = read(policy, "version: v1\nname: agent/x\n", preset=True)
    assert (raw.name, problems) == ("agent/x", [])


def test_a_policy_that_is_no_mapping() -> None:
    assert read(policy, "- a\n") == (None, ["1: a policy must be a mapping (key: value)"])


EXTENDS = [
    ("[base, other]", [("base", 1), ("other", 1)], []),
    ("- base\n- agent/codex\n- {agent/gemini-cli: {telemetry: allow}}\n"
     "- {agent/aider: {telemetry: deny}}\n",
     [("base", 1), ("agent/codex", 2), ("agent/gemini-cli (telemetry: allow)", 3),
      ("agent/aider", 4)], []),
    ("base", [], ['1: extends must be a list, e.g. extends: ["base"]']),
    ("- base\n- ''\n", [("base", 1)], ["2: extends item must be a non-empty string"]),
    ("- {base: {telemetry: allow}}\n", [],
     ["1: only an agent preset takes options in extends (- agent/codex: {telemetry: allow})"]),
    ("- {agent/codex: {telemetry: maybe}}\n", [],
     ["1: invalid telemetry 'maybe'; use deny or allow"]),
    ("- {agent/codex: {telemetri: allow}}\n", [("agent/codex", 1)],
     ['1: unknown key "telemetri" in agent preset options (did you mean "telemetry"?); '
      "known keys: telemetry"]),
]


@pytest.mark.parametrize(("text", "parents", "problems"), EXTENDS)
def test_extends(text: str, parents: list[tuple[str, int]], problems: list[str]) -> None:
    assert read(read_extends, text) == (parents, problems)


TOKENS = [
    ("{ttl: 8h}", 8 * 3600.0, []),
    ("{ttl: 1m}", 60.0, []),
    ("{ttl: 30d}", 30 * 86400.0, []),
    ("{}", None, []),
    ("{ttl: 10s}", None, ["1: tokens.ttl must be from 1m to 30d"]),
    ("{ttl: 31d}", None, ["1: tokens.ttl must be from 1m to 30d"]),
    ("{ttl: soon}", None, ["1: tokens.ttl: 'soon' is not a duration; use e.g. 90s, 15m, 1h30m"]),
    ("8h", None, ["1: tokens must be a mapping (key: value)"]),
]


@pytest.mark.parametrize(("text", "ttl", "problems"), TOKENS)
def test_tokens(text: str, ttl: float | None, problems: list[str]) -> None:
    assert read(read_tokens, text) == (ttl, problems)


SUBJECTS = [
    ("[{namespace: sandboxes, service_account: 'agent-*'}, {namespace: '*'}]",
     [Subject("sandboxes", "agent-*"), Subject("*")], []),
    ("[]", [], ["1: subjects must be a non-empty list, e.g. subjects: [{namespace: sandboxes, "
                "service_account: agent}]"]),
    ("- {service_account: a}\n- {namespace: ns}\n", [Subject("ns")],
     ['1: a subject needs a namespace (a glob: "*" for any)']),
    ("- {namespace: ns, service_account: ''}\n", [],
     ["1: subjects.service_account must be a non-empty string"]),
    ("- {namespace: ns, account: a}\n", [Subject("ns")],
     ['1: unknown key "account" in a subject (did you mean "service_account"?); known keys: '
      "namespace, service_account"]),
]


@pytest.mark.parametrize(("text", "subjects", "problems"), SUBJECTS)
def test_subjects(text: str, subjects: list[Subject], problems: list[str]) -> None:
    assert read(read_subjects, text) == (subjects, problems)


def test_the_policy_keys_are_what_the_loader_reads() -> None:
    """Each key a policy may have is read by the loader's composition (a document with
    every key loads through it)."""
    text = ("version: v1\nname: all\ndescription: d\nmode: report\nextends: [base]\n"
            "egress: []\ncredentials: {}\nbudgets: []\ntokens: {ttl: 1h}\n"
            "subjects: [{namespace: ns}]\nask: {hosts: true}\ndlp: {action: report}\n"
            "telemetry: {content: true}\n---\n"
            "version: v1\nname: base\n")
    assert set(next(yaml.safe_load_all(text))) == set(POLICY_KEYS)
    loaded = load_policy_text("p.yaml", text).policies["all"]
    assert (loaded.mode, loaded.extends, loaded.token_ttl) == ("report", ("base",), 3600)
    assert loaded.subjects == (Subject("ns"),) and loaded.ask is not None
    assert loaded.dlp is not None and loaded.dlp.action == "report"
    assert loaded.telemetry_content is True


TELEMETRY = [
    ("{content: true}\n", True, []),
    ("{content: false}\n", False, []),
    ("{}\n", False, []),
    ("{content: yes please}\n", False, ["1: telemetry.content must be true or false"]),
    ("{content: 1}\n", False, ["1: telemetry.content must be true or false"]),
    ("{contents: true}\n", False,
     ['1: unknown key "contents" in telemetry (did you mean "content"?); known keys: '
      "content"]),
    ("true\n", False, ["1: telemetry must be a mapping (key: value)"]),
]


@pytest.mark.parametrize(("text", "content", "problems"), TELEMETRY)
def test_telemetry(text: str, content: bool, problems: list[str]) -> None:
    """`telemetry: {content: true}` turns content export on; anything else is off, and a
    value that is not a boolean is a problem `policy check` reports."""
    assert read(read_telemetry, text) == (content, problems)


def test_content_export_is_off_unless_the_policy_itself_says_so() -> None:
    """Not inherited: a policy extending one that exports content exports none."""
    text = ("version: v1\nname: parent\ntelemetry: {content: true}\n---\n"
            "version: v1\nname: child\nextends: [parent]\n---\nversion: v1\nname: plain\n")
    loaded = load_policy_text("p.yaml", text).policies
    assert [loaded[n].telemetry_content for n in ("parent", "child", "plain")] == [
        True, False, False]
