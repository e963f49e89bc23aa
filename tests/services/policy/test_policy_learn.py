"""`policy learn`'s rules (services/policy/learn.py) and its replay proof, on audit lines
as the gateway writes them."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from gateway.core.policy.compiled import PolicySet
from gateway.services.policy import load_policy_text
from gateway.services.policy.learn import generalise_paths, id_segment, learn
from gateway.services.policy.learn_io import preset_sets
from gateway.services.policy.learn_proof import prove


@pytest.mark.parametrize(("segment", "is_id"), [
    ("123", True), ("0", True), ("a94a8fe5ccb19ba61c4c0873d391e987982fbbd3", True),
    ("deadbee1", True), ("deadbeef", False),  # hex without a digit reads as a word
    ("123e4567-e89b-12d3-a456-426614174000", True),
    ("AbCdEf0123456789ghijKL", True), ("chat-completions-and-more-words", False),
    ("v1", False), ("repos", False), ("octo", False), ("left-pad", False), ("1.0.0", False),
])
def test_id_segment(segment: str, is_id: bool) -> None:
    assert id_segment(segment) is is_id


@pytest.mark.parametrize(("paths", "rules"), [
    (["/v1/items/1", "/v1/items/2"], ["/v1/items/*"]),
    (["/v1/items/1/comments", "/v1/status"], ["/v1/items/*/comments", "/v1/status"]),
    # four distinct paths under one first segment: their common prefix, then /**
    (["/simple/a", "/simple/b", "/simple/c", "/simple/d"], ["/simple/**"]),
    (["/repos/o/r/issues", "/repos/o/r/pulls", "/repos/o/r/commits", "/repos/o/r/tags"],
     ["/repos/o/r/**"]),
    (["/simple/a", "/simple/b", "/simple/c"], ["/simple/a", "/simple/b", "/simple/c"]),
    # never /** : paths with different first segments stay apart, an id first stays *
    (["/a", "/b", "/c", "/d"], ["/a", "/b", "/c", "/d"]),
    (["/1/x", "/2/y", "/3/z", "/4/w"], ["/*/w", "/*/x", "/*/y", "/*/z"]),
    (["/"], ["/"]),
])
def test_generalise_paths(paths: list[str], rules: list[str]) -> None:
    assert generalise_paths(paths) == rules


ORIGINAL = """\
version: v1
name: agent
mode: learn
egress: []
tokens: {ttl: 8h}
credentials:
  openai: {preset: openai, secret: openai-key}
  other: {hosts: [x.example], secret: x, inject: {bearer: true}}
budgets:
  - {name: daily, per: sandbox, window: 24h, tokens: 1000000, credentials: [openai]}
  - {name: other, per: sandbox, window: 24h, requests: 5, credentials: [other]}
"""


def _line(method: str | None, host: str, path: str | None, *, port: int = 443,
          scheme: str = "https", decision: str = "report", **extra: Any) -> dict[str, Any]:
    return {"sandbox": "s", "policy": "agent", "method": method, "scheme": scheme,
            "host": host, "port": port, "path": path, "decision": decision,
            "credential": None, "models": None, "mcp": None, **extra}


LINES = [
    _line("GET", "pypi.org", "/simple/requests/"),
    _line("GET", "files.pythonhosted.org", "/packages/ab/cd/requests-2.0-py3-none-any.whl"),
    _line("POST", "api.openai.com", "/v1/chat/completions", credential="openai",
          models=["gpt-4o-mini"]),
    _line("POST", "api.openai.com", "/v1/chat/completions", credential="openai",
          models=["gpt-4o"]),
    _line("GET", "api.openai.com", "/v1/models", credential="openai"),
    _line("POST", "mcp.example", "/mcp", mcp=[
        {"method": "tools/call", "name": "search_issues", "decision": "report"},
        {"method": "tools/list", "name": None, "decision": "allow"},
        {"method": "tools/call", "name": "evil", "decision": "allow", "from": "server"}]),
    _line(None, "db.example", None, port=5432, scheme="tcp"),
    _line("CONNECT", "pass.example", None),
    # pypi.org would be a preset host, but a line with a key keeps it as own rules
    _line("GET", "github.com", "/octo/hello.git/info/refs"),
    _line("POST", "github.com", "/octo/hello.git/git-upload-pack"),
    _line("GET", "169.254.169.254", "/latest/meta-data", decision="deny",
          error="forbidden_destination", port=80, scheme="http"),
    _line("GET", "other.example", "/", policy="someone-else"),
]


def _learned() -> tuple[Any, PolicySet]:
    learned = learn(LINES, "agent", presets=preset_sets(), original=ORIGINAL)
    head = load_policy_text("agent.yaml", learned.text)
    return learned, head


def test_learn_writes_the_smallest_policy() -> None:
    learned, _ = _learned()
    doc = yaml.safe_load(learned.text)
    assert doc["extends"] == ["service/github-read", "service/pypi"]
    assert "mode" not in doc and doc["tokens"] == {"ttl": "8h"}
    assert set(doc["credentials"]) == {"openai", "other"}
    assert [b["name"] for b in doc["budgets"]] == ["daily"]  # `other`'s rule is not learned
    assert learned.notes == ["budget other left out: the learned rules inject none of its "
                             "credentials"]
    rules = {(r["host"], tuple(r.get("methods") or ()), tuple(r.get("paths") or ())): r
             for r in doc["egress"]}
    assert set(rules) == {
        ("api.openai.com", ("GET",), ("/v1/models",)),
        ("api.openai.com", ("POST",), ("/v1/chat/completions",)),
        ("db.example", (), ()), ("mcp.example", ("POST",), ("/mcp",)),
        ("pass.example", (), ())}
    chat = rules[("api.openai.com", ("POST",), ("/v1/chat/completions",))]
    assert chat["credential"] == "openai" and chat["models"] == ["gpt-4o", "gpt-4o-mini"]
    assert "models" not in rules[("api.openai.com", ("GET",), ("/v1/models",))]
    assert rules[("db.example", (), ())] == {"host": "db.example", "ports": [5432],
                                             "protocol": "tcp"}
    assert rules[("mcp.example", ("POST",), ("/mcp",))]["mcp"] == {
        "tools": {"allow": ["search_issues"]}}  # never what the server sent
    assert len(learned.learned) == 10 and len(learned.refused) == 1


def test_the_learned_policy_passes_its_replay_proof() -> None:
    learned, head = _learned()
    proof = prove(learned, head)
    assert (proof.ok, proof.allowed, proof.requests) == (True, 10, 10), proof.lines()
    assert proof.leaked == []
    # the host rule of a tunnel seen only as a tunnel allows more than was seen: listed
    assert proof.beyond == [
        "GET https://pass.example/sandbox-gateway-learn-probe: allow (agent.yaml:22)"], \
        proof.beyond


def test_a_proof_fails_when_the_policy_misses_a_line() -> None:
    learned, _ = _learned()
    narrowed = learned.text.replace("    models: [gpt-4o, gpt-4o-mini]\n",
                                    "    models: [gpt-4o]\n")
    assert narrowed != learned.text
    proof = prove(learned, load_policy_text("agent.yaml", narrowed))
    assert not proof.ok and proof.allowed == proof.requests - 1
    assert len(proof.missed) == 1 and "/v1/chat/completions" in proof.missed[0], proof.missed


def test_a_proof_fails_when_the_policy_allows_a_refused_line() -> None:
    learned, _ = _learned()
    wider = learned.text.replace("egress:\n", "egress:\n  - host: 169.254.169.254\n    "
                                 "ports: [80]\n", 1)
    proof = prove(learned, load_policy_text("agent.yaml", wider))
    assert not proof.ok and len(proof.leaked) == 1, proof.lines()


def test_probes_show_what_a_generalised_rule_allows_beyond() -> None:
    lines = [_line("GET", "api.example", f"/docs/{p}") for p in "abcd"]
    learned = learn(lines, "agent", presets={})
    assert "/docs/**" in learned.text
    proof = prove(learned, load_policy_text("agent.yaml", learned.text))
    assert proof.ok and proof.beyond == [], proof.beyond
    lines = [_line("CONNECT", "pass.example", None)]
    learned = learn(lines, "agent", presets={})
    proof = prove(learned, load_policy_text("agent.yaml", learned.text))
    assert proof.ok and len(proof.beyond) == 1 and "pass.example" in proof.beyond[0]
