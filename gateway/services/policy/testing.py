"""Policy tests: cases in ``<policies>/tests/*.yaml``, decided by the pure engine.

A test file is a mapping with a ``cases`` list::

    cases:
      - name: pypi simple index is allowed
        policy: coding-agent
        method: GET                     # CONNECT = the tunnel-level decision
        url: https://pypi.org/simple/requests/
        expect: allow                   # allow | deny | report
        # optional: error (expected code), rule (expected file:line, or null),
        #           headers (a map), model (a string), body (a map: JSON, or a string),
        #           mcp (an MCP call on a rule with mcp:, METHOD[:NAME]: its JSON-RPC)

A case is decided by the gateway's own decision code (``gateway.core.evaluate``): the
policy, the credential's static checks and the metering step over empty counters. So
it can check the result, the rule (``file:line``, relative to the policies directory)
and the codes those produce: ``policy_denied``, ``credential_requires_tls``,
``model_not_allowed``, ``metering_unavailable``, ``minted_secret_refused``,
``budget_exceeded`` for a call no budget window can hold even unused, and
``mcp_denied`` (an ``mcp:`` rule's calls), ``secret_detected`` (a credential in the
URL or the body on a rule with ``dlp:``; headers are not part of a case). ``model`` is
added to the JSON ``body`` as its ``"model"``. Codes that come from other checks
(Host header vs tunnel, resolved address, token scope, key leaks, recorded usage,
runtime failures) are refused at parse time with the reason, so a test never asserts
something this runner cannot see. ``policy explain --resolve`` covers destinations.

Pure: parsing takes text, running takes a PolicySet. File discovery is the CLI's.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from gateway.core.evaluate import request_for
from gateway.core.mcp import request_body
from gateway.core.policy.compiled import PolicySet
from gateway.core.policy.model import Request

if TYPE_CHECKING:
    from gateway.services.metering import Metering

__all__ = [
    "CHECKED_CODES",
    "POLICY_DENIED",
    "CaseResult",
    "PolicyCase",
    "parse_cases",
    "relative_source",
    "relative_text",
    "run_case",
    "run_cases",
]

Expect = Literal["allow", "deny", "report"]
EXPECTS: tuple[Expect, ...] = ("allow", "deny", "report")
POLICY_DENIED = "policy_denied"

# Gateway error codes a policy test cannot produce, and why (see the module docstring).
UNREACHABLE_CODES: Mapping[str, str] = {
    "host_mismatch": "it compares the Host header / :authority / SNI with the tunnel",
    "forbidden_destination": "it is the destination check after resolution "
                             "(try `policy explain --resolve`)",
    "unresolvable": "it is the destination check after resolution "
                    "(try `policy explain --resolve`)",
    "bad_destination": "it is the destination check after resolution",
    "exfiltration_blocked": "it scans the request's bytes for tokens and keys",
    "credential_not_in_scope": "it depends on the token's scope",
    "auth_required": "it is a token check", "sandbox_mismatch": "it is a token check",
    "unknown_sandbox": "it is a token check",
    "identity_unknown": "it is the pod identity check (identity.kubernetes)",
    "identity_unavailable": "it depends on the pod watch (identity.kubernetes)",
    "too_many_connections": "it depends on open connections",
    "upstream_failed": "it is a runtime failure", "upstream_timeout": "it is a runtime failure",
    "secret_unavailable": "it is a runtime failure",
    "credential_unavailable": "it is a runtime failure",
    "gateway_error": "it is a runtime failure", "bad_request": "it is a runtime failure",
}

# The codes a case can expect: what the decision code `evaluate` runs can answer.
CHECKED_CODES = (POLICY_DENIED, "credential_requires_tls", "model_not_allowed",
                 "metering_unavailable", "minted_secret_refused", "budget_exceeded",
                 "mcp_denied", "secret_detected")

_FILE_KEYS = ("cases", "description")
_CASE_KEYS = ("name", "policy", "method", "url", "expect", "error", "rule", "headers", "model",
              "body", "mcp")
_METHOD = re.compile(r"[A-Za-z][A-Za-z_-]{0,31}")
_RULE = re.compile(r".+:[0-9]+")

@dataclass(frozen=True, slots=True)
class PolicyCase:
    """One test case as written; ``source`` is ``file:line`` of its entry."""

    name: str
    policy: str
    method: str
    url: str
    expect: Expect
    source: str
    request: Request
    error: str | None = None
    check_rule: bool = False
    rule: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    model: str | None = None
    body: bytes | None = None  # the request body the case sends (model added)


@dataclass(frozen=True, slots=True)
class CaseResult:
    """A case and what the engine answered; ``diff`` lists (field, expected, got)."""

    case: PolicyCase
    result: str
    error: str | None
    rule: str | None
    reason: str
    diff: tuple[tuple[str, str, str], ...]
    model_checked: bool = False

    @property
    def passed(self) -> bool:
        return not self.diff


class _Cases:
    """Walks composed YAML nodes of one test file, collecting ``file:line`` errors."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.errors: list[str] = []

    def err(self, node: Node | None, message: str) -> None:
        line = node.start_mark.line + 1 if node is not None else 1
        self.errors.append(f"{self.file}:{line}: {message}")

    def keys(self, node: Node, allowed: tuple[str, ...], what: str) -> dict[str, Node] | None:
        if not isinstance(node, MappingNode):
            self.err(node, f"{what} must be a mapping (key: value)")
            return None
        out: dict[str, Node] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, ScalarNode) else None
            if key not in allowed:
                self.err(key_node, f"unknown key {key!r} in {what}; known keys: "
                                   f"{', '.join(allowed)}")
            elif key in out:
                self.err(key_node, f"duplicate key {key!r}")
            else:
                out[key] = value_node
        return out

    def string(self, node: Node, what: str) -> str | None:
        if isinstance(node, ScalarNode) and node.tag == "tag:yaml.org,2002:str" and node.value:
            return str(node.value)
        self.err(node, f"{what} must be a non-empty string")
        return None

    def parse(self, text: str) -> list[PolicyCase]:
        try:
            documents = [d for d in yaml.compose_all(text, Loader=yaml.SafeLoader)
                         if d is not None]
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark is not None else 1
            self.errors.append(f"{self.file}:{line}: invalid YAML: {exc.problem or exc}")
            return []
        except yaml.YAMLError as exc:
            self.errors.append(f"{self.file}:1: invalid YAML: {exc}")
            return []
        if len(documents) != 1:
            self.errors.append(f"{self.file}:1: a test file is one mapping with a cases: list")
            return []
        keys = self.keys(documents[0], _FILE_KEYS, "a test file")
        if keys is None:
            return []
        cases_node = keys.get("cases")
        if not isinstance(cases_node, SequenceNode) or not cases_node.value:
            self.err(cases_node or documents[0], "cases must be a non-empty list of cases")
            return []
        out: list[PolicyCase] = []
        names: dict[str, int] = {}
        for node in cases_node.value:
            case = self.case(node)
            if case is None:
                continue
            line = node.start_mark.line + 1
            if case.name in names:
                self.err(node, f"duplicate case name {case.name!r} (first at line "
                               f"{names[case.name]})")
                continue
            names[case.name] = line
            out.append(case)
        return out

    def case(self, node: Node) -> PolicyCase | None:
        keys = self.keys(node, _CASE_KEYS, "a case")
        if keys is None:
            return None
        values: dict[str, str] = {}
        ok = True
        for required in ("name", "policy", "method", "url", "expect"):
            if required not in keys:
                self.err(node, f"case needs {required}:")
                ok = False
                continue
            value = self.string(keys[required], required)
            if value is None:
                ok = False
            else:
                values[required] = value
        if not ok:
            return None
        method = values["method"].upper()
        if not _METHOD.fullmatch(method):
            self.err(keys["method"], f"invalid method {values['method']!r}; e.g. GET, CONNECT")
            return None
        expect = values["expect"]
        if expect not in EXPECTS:
            self.err(keys["expect"], f"expect must be one of {', '.join(EXPECTS)}")
            return None
        try:
            request = request_for(method, values["url"])
        except ValueError as exc:
            self.err(keys["url"], str(exc))
            return None
        error = self.error(keys.get("error"), expect)
        check_rule, rule = False, None
        if "rule" in keys:
            check_rule, rule, ok = self.rule(keys["rule"])
        headers = self.headers(keys["headers"]) if "headers" in keys else {}
        model = self.string(keys["model"], "model") if "model" in keys else None
        body = self.body(keys.get("body"), model)
        if "mcp" in keys:  # an MCP call on a rule with mcp: (`METHOD[:NAME]`)
            call = self.string(keys["mcp"], "mcp")
            if body is not None or call is None:
                self.err(keys["mcp"], "mcp: is the call (METHOD[:NAME]) and the case's "
                         "body; give one of mcp: and body:/model:")
                return None
            try:
                body = request_body(call)
            except ValueError as exc:
                self.err(keys["mcp"], str(exc))
                return None
        if (error is False or not ok or headers is None or body is False
                or ("model" in keys and model is None)):
            return None
        return PolicyCase(
            name=values["name"], policy=values["policy"], method=method, url=values["url"],
            expect=expect,
            source=f"{self.file}:{node.start_mark.line + 1}", request=request,
            error=error or None, check_rule=check_rule, rule=rule, headers=headers,
            model=model, body=body,
        )

    def body(self, node: Node | None, model: str | None) -> bytes | Literal[False] | None:
        """The case's request body: a mapping as JSON (``model`` added), a string as is;
        None for none; False if invalid (reported)."""
        value: Any = None
        if node is not None:
            try:
                value = yaml.safe_load(yaml.serialize(node))
            except yaml.YAMLError:
                value = object()
            if not isinstance(value, dict | str):
                self.err(node, "body must be a mapping (sent as JSON) or a string")
                return False
        if model is not None:
            if isinstance(value, str):
                self.err(node, "model: is added to a JSON body; write it into the body string")
                return False
            value = {**(value or {}), "model": model}
        if value is None:
            return None
        return value.encode() if isinstance(value, str) else json.dumps(value).encode()

    def error(self, node: Node | None, expect: str) -> str | Literal[False] | None:
        """The expected code, None if not given, False if invalid (reported)."""
        if node is None:
            return None
        code = self.string(node, "error")
        if code is None:
            return False
        if code in UNREACHABLE_CODES:
            self.err(node, f"error {code} cannot be checked by policy test: "
                           f"{UNREACHABLE_CODES[code]}; it checks "
                           f"{', '.join(CHECKED_CODES)}")
            return False
        if code not in CHECKED_CODES:
            self.err(node, f"unknown error code {code!r}; policy test checks "
                           f"{', '.join(CHECKED_CODES)}")
            return False
        if expect != "deny":
            self.err(node, f"error {code} needs expect: deny (expect {expect} is answered "
                           "without an error)")
            return False
        return code

    def rule(self, node: Node) -> tuple[bool, str | None, bool]:
        if isinstance(node, ScalarNode) and node.tag == "tag:yaml.org,2002:null":
            return True, None, True
        value = self.string(node, "rule")
        if value is None or not _RULE.fullmatch(value):
            if value is not None:
                self.err(node, f"rule must be file:line (e.g. coding-agent.yaml:12) or null, "
                               f"not {value!r}")
            return False, None, False
        return True, value, True

    def headers(self, node: Node) -> dict[str, str] | None:
        if not isinstance(node, MappingNode):
            self.err(node, "headers must be a mapping of name: value")
            return None
        out: dict[str, str] = {}
        for key_node, value_node in node.value:
            name = self.string(key_node, "a header name")
            if not isinstance(value_node, ScalarNode):
                self.err(value_node, "a header value must be a string")
                return None
            if name is None:
                return None
            out[name] = str(value_node.value)
        return out


def parse_cases(file: str, text: str) -> tuple[list[PolicyCase], list[str]]:
    """The cases of one test file and its problems (``file:line: message``)."""
    parser = _Cases(file)
    cases = parser.parse(text)
    return cases, parser.errors


def _prefixes(root: str) -> tuple[str, ...]:
    """How sources loaded from ``root`` start: the directory's name (``source_name``),
    or its path (sources of texts loaded under their paths)."""
    if not root:
        return ()
    name = os.path.basename(os.path.abspath(root))
    return tuple(dict.fromkeys(p + "/" for p in (name, root.rstrip("/")) if p))


def relative_source(source: str, root: str) -> str:
    """``file:line`` with the policies directory ``root`` stripped (as tests write it)."""
    for prefix in _prefixes(root):
        if source.startswith(prefix):
            return source[len(prefix):]
    return source


def relative_text(text: str, root: str) -> str:
    """``text`` (a decision's reason) with every source in it relative to ``root``."""
    for prefix in _prefixes(root):
        text = re.sub(r"(?<![\w./-])" + re.escape(prefix), "", text)
    return text


def run_case(policy_set: PolicySet, case: PolicyCase, root: str = "",
             metering: Metering | None = None) -> CaseResult:
    """Decide one case as the gateway would (``evaluate``) and compare it with its
    expectations. ``metering``: one with the gateway's pricing (cost budgets)."""
    from gateway.core.evaluate import evaluate
    from gateway.services.dlp.detectors import for_tools
    from gateway.services.metering import static_metering

    policy = policy_set.get(case.policy)
    if policy is None:
        known = ", ".join(sorted(policy_set.policies)) or "none"
        reason = f"policy {case.policy!r} does not exist (known: {known})"
        return CaseResult(case, "-", None, None, reason,
                          (("policy", case.policy, "(missing)"),))
    verdict = evaluate(policy_set, policy, case.request, body=case.body,
                       metering=metering or static_metering(),
                       detectors=for_tools() if policy_set.uses_dlp else None)
    error = verdict.error if verdict.result == "deny" else None
    rule = relative_source(verdict.rule, root) if verdict.rule else None
    diff: list[tuple[str, str, str]] = []
    if verdict.result != case.expect:
        diff.append(("decision", case.expect, verdict.result))
    if case.error is not None and case.error != error:
        diff.append(("error", case.error, error or "(none)"))
    if case.check_rule and case.rule != rule and case.rule != verdict.rule:
        diff.append(("rule", case.rule or "(none)", rule or "(none)"))
    return CaseResult(case, verdict.result, error, rule, verdict.reason, tuple(diff),
                      case.model is not None)


def run_cases(policy_set: PolicySet, cases: Sequence[PolicyCase], root: str = "",
              metering: Metering | None = None) -> list[CaseResult]:
    """Every case's result, in order."""
    return [run_case(policy_set, case, root, metering) for case in cases]
