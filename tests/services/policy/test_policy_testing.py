"""`policy test`: parsing (file:line errors), the pure runner, the CLI and its JUnit XML."""

from __future__ import annotations

import json
import textwrap
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.core.evaluate import request_for
from gateway.core.policy import PolicySet, Request
from gateway.services.policy import load_policy_dir, load_policy_texts
from gateway.services.policy.testing import PolicyCase, parse_cases, run_case, run_cases

ROOT = Path(__file__).resolve().parents[3]

AGENT = """\
version: v1
name: agent
extends: [base]
egress:
  - host: api.github.com
    methods: [GET]
    paths: ["/repos/**"]
  - host: api.openai.com
    credential: openai
credentials:
  openai: {preset: openai, secret: openai-api-key}
"""
BASE = """\
version: v1
name: base
egress:
  - host: pypi.org
"""
REPORT = """\
version: v1
name: watch
mode: report
egress:
  - host: pypi.org
"""


def cases(text: str) -> list[PolicyCase]:
    found, errors = parse_cases("t.yaml", textwrap.dedent(text))
    assert errors == []
    return found


def errors(text: str) -> list[str]:
    return parse_cases("t.yaml", textwrap.dedent(text))[1]


@pytest.fixture
def policies() -> PolicySet:
    return load_policy_texts({"p/agent.yaml": AGENT, "p/base.yaml": BASE, "p/watch.yaml": REPORT})


# --- parsing --------------------------------------------------------------------------


def test_parse_a_full_case() -> None:
    (case,) = cases("""\
        cases:
          - name: chat
            policy: agent
            method: post
            url: https://api.openai.com/v1/chat/completions
            expect: allow
            rule: agent.yaml:8
            headers: {Content-Type: application/json, X-Retry: 3}
            model: gpt-4o-mini
        """)
    assert case.method == "POST" and case.request == Request(
        "POST", "https", "api.openai.com", 443, "/v1/chat/completions")
    assert case.check_rule and case.rule == "agent.yaml:8"
    assert case.headers == {"Content-Type": "application/json", "X-Retry": "3"}
    assert case.model == "gpt-4o-mini" and case.source == "t.yaml:2"


def test_connect_cases_are_tunnel_level() -> None:
    (case,) = cases("""\
        cases:
          - {name: ssh, policy: agent, method: CONNECT, url: "tcp://github.com:22", expect: deny}
        """)
    assert case.request == Request(None, "tcp", "github.com", 22, None)


@pytest.mark.parametrize(("text", "message"), [
    ("cases: []", "t.yaml:1: cases must be a non-empty list"),
    ("kases: []", "t.yaml:1: unknown key 'kases' in a test file"),
    ("cases:\n  - {name: a, policy: p, method: GET, url: x.test}",
     "t.yaml:2: case needs expect:"),
    ("cases:\n  - {name: a, policy: p, method: GET, url: x.test, expect: allowed}",
     "t.yaml:2: expect must be one of allow, deny, report"),
    ("cases:\n  - {name: a, policy: p, method: 'G T', url: x.test, expect: deny}",
     "t.yaml:2: invalid method"),
    ("cases:\n  - {name: a, policy: p, method: GET, url: 'ftp://x.test/', expect: deny}",
     "t.yaml:2: unsupported URL scheme 'ftp'"),
    ("cases:\n  - {name: a, policy: p, method: GET, url: x.test, expect: deny, extra: 1}",
     "t.yaml:2: unknown key 'extra' in a case"),
    ("cases:\n  - {name: a, policy: p, method: GET, url: x.test, expect: deny,\n"
     "     error: host_mismatch}",
     "t.yaml:3: error host_mismatch cannot be checked by policy test: it compares the Host"),
    ("cases:\n  - {name: a, policy: p, method: GET, url: x.test, expect: deny,\n"
     "     error: forbidden_destination}", "policy explain --resolve"),
    ("cases:\n  - {name: a, policy: p, method: GET, url: x.test, expect: deny, error: nope}",
     "unknown error code 'nope'; policy test checks policy_denied, credential_requires_tls"),
    ("cases:\n  - {name: a, policy: p, method: GET, url: x.test, expect: allow,\n"
     "     error: policy_denied}", "t.yaml:3: error policy_denied needs expect: deny"),
    ("cases:\n  - {name: a, policy: p, method: GET, url: x.test, expect: deny, rule: agent}",
     "rule must be file:line"),
    ("cases:\n  - {name: a, policy: p, method: GET, url: x.test, expect: deny, headers: [x]}",
     "headers must be a mapping"),
    ("cases:\n  - {name: a, policy: p, method: GET, url: x.test, expect: deny}\n"
     "  - {name: a, policy: p, method: GET, url: y.test, expect: deny}",
     "t.yaml:3: duplicate case name 'a' (first at line 2)"),
    ("cases:\n  - {name: a, policy: p, method: GET, url: x.test, expect: deny, model: 4}",
     "model must be a non-empty string"),
    ("cases: [", "t.yaml:1: invalid YAML"),
])
def test_invalid_cases_name_file_and_line(text: str, message: str) -> None:
    found = errors(text)
    assert any(message in e for e in found), found


# --- running --------------------------------------------------------------------------


def test_pass_and_fail_with_a_diff(policies: PolicySet) -> None:
    found = cases("""\
        cases:
          - {name: ok, policy: agent, method: GET, url: "https://api.github.com/repos/a/b",
             expect: allow, rule: agent.yaml:5}
          - {name: inherited, policy: agent, method: GET, url: "https://pypi.org/simple/",
             expect: allow, rule: base.yaml:4}
          - {name: wrong, policy: agent, method: POST, url: "https://api.github.com/repos/a/b",
             expect: allow, rule: agent.yaml:8}
          - {name: denied, policy: agent, method: GET, url: "https://evil.test/",
             expect: deny, error: policy_denied, rule: null}
          - {name: report mode, policy: watch, method: GET, url: "https://evil.test/",
             expect: report}
          - {name: gone, policy: nope, method: GET, url: "https://pypi.org/", expect: allow}
        """)
    results = run_cases(policies, found, root="p")
    assert [r.passed for r in results] == [True, True, False, True, True, False]
    wrong = results[2]
    assert wrong.diff == (("decision", "allow", "deny"), ("rule", "agent.yaml:8", "agent.yaml:5"))
    assert "method POST is not allowed" in wrong.reason
    assert results[3].error == "policy_denied" and results[3].rule is None
    assert results[5].diff == (("policy", "nope", "(missing)"),)


def test_rule_may_also_be_the_full_source(policies: PolicySet) -> None:
    (case,) = cases("""\
        cases:
          - {name: ok, policy: agent, method: GET, url: "https://pypi.org/",
             expect: allow, rule: p/base.yaml:4}
        """)
    assert run_case(policies, case, root="p").passed


METERED = """\
version: v1
name: metered
egress:
  - host: api.openai.com
    credential: openai
    models: ["gpt-4o-mini*"]
    allow_minted_secrets: true
  - host: api.anthropic.com
    credential: anthropic
    metering: required
  - host: api.mistral.ai
    credential: mistral
budgets:
  - {name: daily, per: sandbox, window: 24h, tokens: 10000, credentials: [mistral]}
credentials:
  openai: {preset: openai, secret: k1}
  anthropic: {preset: anthropic, secret: k2}
  mistral: {preset: mistral, secret: k3}
"""
WATCHED = """\
version: v1
name: watched
mode: report
extends: [metered]
egress: []
"""


@pytest.mark.parametrize(("method", "url", "body", "expect", "error"), [
    # model allowlists, as the proxy checks them (body, spelling of the path, case)
    ("POST", "https://api.openai.com/v1/chat/completions", {"model": "gpt-4o-mini"},
     "allow", None),
    ("POST", "https://api.openai.com/v1/chat/completions", {"model": "gpt-4o"},
     "deny", "model_not_allowed"),
    ("POST", "https://api.openai.com/v1/chat/completion%73/", {"model": "gpt-4o"},
     "deny", "model_not_allowed"),
    ("POST", "https://api.openai.com/v1/chat/completions",
     '{"model": "gpt-4o-mini", "Model": "gpt-4o"}', "deny", "model_not_allowed"),
    ("POST", "https://api.openai.com/v1/chat/completions", None, "deny",
     "model_not_allowed"),
    ("GET", "https://api.openai.com/v1/models", None, "allow", None),
    # a credential never goes over cleartext
    ("POST", "http://api.openai.com/v1/chat/completions", {"model": "gpt-4o-mini"},
     "deny", "credential_requires_tls"),
    # provider-minted secrets: allowed on the rule that says so, refused elsewhere
    ("POST", "https://api.openai.com/v1/realtime/client_secrets",
     {"session": {"type": "realtime", "model": "gpt-4o-mini-realtime"}}, "allow", None),
    ("POST", "https://api.openai.com/v1/realtime/client_secrets",
     {"session": {"type": "realtime", "model": "gpt-realtime"}}, "deny", "model_not_allowed"),
    ("POST", "https://api.anthropic.com/v1/realtime/client_secrets", {}, "deny",
     "minted_secret_refused"),
    # metering: required / a token budget: what cannot be metered is refused
    ("POST", "https://api.anthropic.com/v1/messages", {"model": "claude", "max_tokens": 9},
     "allow", None),
    ("POST", "https://api.anthropic.com/v1/messages/batches", {"requests": []}, "deny",
     "metering_unavailable"),
    ("POST", "https://api.anthropic.com/v1/messages", "not json", "deny",
     "metering_unavailable"),
    ("POST", "https://api.mistral.ai/v1/images/generations", {"prompt": "x"}, "deny",
     "metering_unavailable"),
    ("POST", "https://api.openai.com/v1/responses",
     {"model": "gpt-4o-mini", "background": True}, "allow", None),  # (no budget there)
    # a call no budget window can hold, even unused
    ("POST", "https://api.mistral.ai/v1/chat/completions",
     {"model": "m", "max_tokens": 20000}, "deny", "budget_exceeded"),
    ("POST", "https://api.mistral.ai/v1/chat/completions", {"model": "m", "max_tokens": 900},
     "allow", None),
])
def test_cases_are_decided_as_the_gateway_decides(method: str, url: str, body: object,
                                                  expect: str, error: str | None) -> None:
    policies = load_policy_texts({"metered.yaml": METERED, "watched.yaml": WATCHED})
    raw = (body.encode() if isinstance(body, str) else
           None if body is None else json.dumps(body).encode())
    case = PolicyCase("c", "metered", method, url, expect, "t.yaml:1",  # type: ignore[arg-type]
                      request_for(method, url), error, body=raw)
    result = run_case(policies, case)
    assert result.passed, (result.diff, result.reason)
    # Under mode: report the same request is forwarded, the would-deny recorded.
    watched = run_case(policies, replace(case, policy="watched", error=None,
                                         expect="report" if expect == "deny" else "allow"))
    if error not in ("credential_requires_tls",):
        assert watched.passed, (watched.diff, watched.reason)


def test_model_goes_into_the_body() -> None:
    (case,) = cases("""\
        cases:
          - {name: m, policy: metered, method: POST,
             url: "https://api.openai.com/v1/chat/completions",
             body: {messages: []}, model: gpt-4o, expect: deny, error: model_not_allowed}
        """)
    assert json.loads(case.body or b"") == {"messages": [], "model": "gpt-4o"}
    result = run_case(load_policy_texts({"metered.yaml": METERED}), case)
    assert result.passed and result.model_checked
    assert 'model "gpt-4o" is not allowed by rule metered.yaml:4' in result.reason


# --- CLI ------------------------------------------------------------------------------


def write_policies(tmp_path: Path, tests: dict[str, str]) -> Path:
    pdir = tmp_path / "policies"
    (pdir / "tests").mkdir(parents=True)
    (pdir / "agent.yaml").write_text(AGENT)
    (pdir / "base.yaml").write_text(BASE)
    for name, text in tests.items():
        (pdir / "tests" / name).write_text(textwrap.dedent(text))
    return pdir


PASSING = """\
    cases:
      - name: github repo reads
        policy: agent
        method: GET
        url: https://api.github.com/repos/a/b
        expect: allow
        rule: agent.yaml:5
"""
FAILING = """\
    cases:
      - name: pypi is allowed
        policy: agent
        method: GET
        url: https://pypi.org/simple/
        expect: allow
      - name: github writes are allowed
        policy: agent
        method: POST
        url: https://api.github.com/repos/a/b
        expect: allow
        model: gpt-4o
"""


def test_cli_all_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pdir = write_policies(tmp_path, {"a.yaml": PASSING})
    assert main(["policy", "test", str(pdir)]) == 0
    out = capsys.readouterr().out
    assert "PASS  github repo reads" in out and "1 passed, 0 failed" in out
    assert f"policies: {pdir} (revision sha256:" in out


def test_cli_failure_diff_and_junit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pdir = write_policies(tmp_path, {"a.yaml": PASSING, "b.yaml": FAILING})
    junit = tmp_path / "out" / "junit.xml"
    junit.parent.mkdir()
    assert main(["policy", "test", str(pdir), "--junit", str(junit)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  github writes are allowed" in out
    assert f"({pdir}/tests/b.yaml:7)" in out
    assert "- decision: allow\n        + decision: deny" in out
    assert "reason: method POST is not allowed for api.github.com" in out
    assert "2 passed, 1 failed (3 cases in 2 file(s))" in out

    root = ET.parse(junit).getroot()
    assert root.tag == "testsuites"
    assert (root.get("tests"), root.get("failures")) == ("3", "1")
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == [f"{pdir}/tests/a.yaml", f"{pdir}/tests/b.yaml"]
    assert [(s.get("tests"), s.get("failures")) for s in suites] == [("1", "0"), ("2", "1")]
    failed = suites[1].findall("testcase")[1]
    assert failed.get("name") == "github writes are allowed" and failed.get("line") == "7"
    failure = failed.find("failure")
    assert failure is not None
    assert failure.get("message") == "decision: expected allow, got deny"
    assert "method POST is not allowed" in (failure.text or "")
    props = {p.get("name"): p.get("value") for p in failed.iter("property")}
    assert props == {"model": "gpt-4o", "model_checked": "true"}
    assert suites[1].findall("testcase")[0].find("failure") is None


def test_cli_invalid_test_file_exits_2(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    pdir = write_policies(tmp_path, {"a.yaml": PASSING, "bad.yaml": """\
        cases:
          - name: x
            policy: agent
            method: GET
            url: https://pypi.org/
            expect: deny
            error: exfiltration_blocked
        """})
    assert main(["policy", "test", str(pdir)]) == 2
    err = capsys.readouterr().err
    assert f"{pdir}/tests/bad.yaml:7: error exfiltration_blocked cannot be checked" in err


def test_cli_no_tests_or_bad_policies_exit_2(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    pdir = write_policies(tmp_path, {})
    assert main(["policy", "test", str(pdir)]) == 2
    assert "no test files" in capsys.readouterr().err
    (pdir / "tests" / "a.yaml").write_text(textwrap.dedent(PASSING))
    (pdir / "agent.yaml").write_text(AGENT.replace("version: v1", "version: v9"))
    assert main(["policy", "test", str(pdir)]) == 2
    assert "unsupported version" in capsys.readouterr().err


@pytest.mark.parametrize("directory", ["policies", "examples/quickstart/policies"])
def test_shipped_policies_pass_and_cover_every_rule(directory: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    pdir = ROOT / directory
    assert main(["policy", "test", str(pdir)]) == 0, capsys.readouterr()
    policy_set = load_policy_dir(pdir)
    found: list[PolicyCase] = []
    for file in sorted((pdir / "tests").glob("*.yaml")):
        found += parse_cases(str(file), file.read_text())[0]
    allowed_by = {r.rule for r in run_cases(policy_set, found, str(pdir)) if r.result == "allow"}
    written = {f"{Path(rule.source).name}" for p in policy_set.policies.values()
               for rule in p.own_rules}
    assert written - allowed_by == set(), "rules no allow case exercises"
    denied = [r for r in run_cases(policy_set, found, str(pdir)) if r.result == "deny"]
    assert denied, "each shipped test file set checks refusals too"


def test_mcp_cases_are_decided_as_the_proxy_decides_them() -> None:
    """`mcp: METHOD[:NAME]` sends that call's JSON-RPC through the pipeline
    (core/mcp.judge), so a case can expect mcp_denied."""
    policies = load_policy_texts({"p/m.yaml": """version: v1
name: m
egress:
  - host: mcp.example
    mcp: {tools: {allow: ["search_*"]}}
"""})
    found = cases("""\
        cases:
          - {name: allowed tool, policy: m, method: POST, url: "https://mcp.example/mcp",
             mcp: "tools/call:search_issues", expect: allow}
          - {name: other tool, policy: m, method: POST, url: "https://mcp.example/mcp",
             mcp: "tools/call:delete_repo", expect: deny, error: mcp_denied}
          - {name: the list, policy: m, method: POST, url: "https://mcp.example/mcp",
             mcp: tools/list, expect: allow}
        """)
    assert [r.passed for r in run_cases(policies, found, root="p")] == [True, True, True]
    (problem,) = errors("""\
        cases:
          - {name: x, policy: m, method: POST, url: "https://mcp.example/mcp",
             mcp: "tools/call", expect: allow}
        """)
    assert "tools/call needs what it names" in problem
