"""Replay recorded traffic under two policy sets and group the decisions that change.

Audit lines (JSON, one per line: ``sandbox``, ``policy``, ``method``, ``scheme``,
``host``, ``port``, ``path``, optional ``models``, ``mcp`` and ``count``) are streamed
once and deduplicated on (policy, method, scheme, host, port, path, models, MCP calls)
with counts; each distinct request is decided once under each set. ``CONNECT`` or null
methods are tunnel-level decisions (``Request(None, "https", host, port, None)``;
``"tcp"`` when the line's scheme says raw TCP). Lines without a policy or host,
unreadable or malformed, are skipped and counted. A policy missing from one set denies
there (the gateway refuses tokens naming it). Each request is decided by the gateway's
decision pipeline (``core/evaluate.py``: the policy, the credential's static checks and
the body stage on a body rebuilt from what the line shows: the models the request
reached (``models``, written where a rule has a model allowlist; else ``usage.model``,
or a ``model`` field), as ``{"model": first, "models": [the others]}``, so a model
allowlist that changes shows, fallbacks included; and the MCP calls the client sent
(``mcp``, its records not ``from`` the server), as the JSON-RPC request or batch they
were, so a tool allowlist that changes shows). What a line cannot show (the shape of a
body the gateway refused unread) is not replayed.

Changes are grouped by (category, policy, host), largest first: newly denied
(allowed before, denied now), newly allowed, then other changes (allowed both ways
but by a different rule, credential, interception or mode). Pure: lines in, report out.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.core.evaluate import UNSEEN, Unseen, Verdict, evaluate
from gateway.core.mcp import calls_body
from gateway.core.policy.compiled import Policy, PolicySet
from gateway.core.policy.hosts import normalize_host
from gateway.core.policy.model import DEFAULT_HTTP_PORT, DEFAULT_HTTPS_PORT, Request
from gateway.services.metering import static_metering
from gateway.services.policy.testing import relative_source, relative_text

__all__ = [
    "CATEGORIES",
    "Outcome",
    "ReplayExample",
    "ReplayGroup",
    "ReplayReport",
    "replay",
]

Category = Literal["newly_denied", "newly_allowed", "changed"]
CATEGORIES: tuple[Category, ...] = ("newly_denied", "newly_allowed", "changed")
MAX_EXAMPLES = 3
_MAX_SHOWN = 64  # models and MCP calls read from one line


@dataclass(frozen=True, slots=True)
class Outcome:
    """A decision reduced to what a change can alter.

    ``rule_id`` is the deciding rule's identity (defining policy, host, protocol), not
    its line: a rule that moves or is narrowed but still decides a request does not
    make that request a change; a request now decided by another rule does.
    """

    result: str
    reason: str
    rule: str | None
    rule_id: tuple[str, str, str] | None
    credential: str | None = None
    inspect: bool = False

    @property
    def allowed(self) -> bool:
        return self.result != "deny"

    def short(self) -> str:
        text = self.result
        extra = [x for x in (self.rule, self.credential and f"credential {self.credential}",
                             "inspect" if self.inspect else None) if x]
        return f"{text} ({', '.join(extra)})" if extra and self.allowed else text

    def to_dict(self) -> dict[str, Any]:
        return {"decision": self.result, "reason": self.reason, "rule": self.rule,
                "credential": self.credential, "inspect": self.inspect}


def _outcome(verdict: Verdict, root: str, tunnel: bool) -> Outcome:
    decision = verdict.decision
    rule = decision.rule
    rule_id = None if rule is None else (rule.policy, rule.host, rule.protocol)
    reason = relative_text(verdict.reason, root)
    return Outcome(verdict.result, reason,
                   relative_source(rule.source, root) if rule else None, rule_id,
                   decision.credential, decision.inspect if tunnel else False)


@dataclass(frozen=True, slots=True)
class ReplayExample:
    """One distinct recorded request whose decision changes, with how often it was seen."""

    method: str | None
    scheme: str
    host: str
    port: int
    path: str | None
    count: int
    sandbox: str | None
    model: str | None
    base: Outcome
    new: Outcome

    def describe(self) -> str:
        if self.method is None:
            return f"CONNECT {self.host}:{self.port}" + (" (tcp)" if self.scheme == "tcp" else "")
        default = DEFAULT_HTTPS_PORT if self.scheme == "https" else DEFAULT_HTTP_PORT
        port = "" if self.port == default else f":{self.port}"
        return f"{self.method} {self.scheme}://{self.host}{port}{self.path or ''}"

    def to_dict(self) -> dict[str, Any]:
        return {"request": self.describe(), "method": self.method, "scheme": self.scheme,
                "host": self.host, "port": self.port, "path": self.path,
                "count": self.count, "sandbox": self.sandbox, "model": self.model,
                "base": self.base.to_dict(), "new": self.new.to_dict()}


@dataclass(slots=True)
class ReplayGroup:
    """Changed requests of one policy and host in one category."""

    category: Category
    policy: str
    host: str
    count: int = 0
    distinct: int = 0
    examples: list[ReplayExample] = field(default_factory=list)

    @property
    def reason(self) -> str:
        """Why the largest example is decided as it is now."""
        return self.examples[0].new.reason if self.examples else ""

    def to_dict(self) -> dict[str, Any]:
        return {"category": self.category, "policy": self.policy, "host": self.host,
                "requests": self.count, "distinct": self.distinct, "reason": self.reason,
                "examples": [e.to_dict() for e in self.examples]}


@dataclass(slots=True)
class ReplayReport:
    """Counts and the changed groups of one replay."""

    lines: int = 0
    requests: int = 0
    distinct: int = 0
    seconds: float = 0.0
    skipped: dict[str, int] = field(default_factory=dict)
    by_category: dict[str, list[ReplayGroup]] = field(default_factory=dict)

    def groups(self, category: str) -> list[ReplayGroup]:
        return self.by_category.get(category, [])

    def count(self, category: str) -> int:
        return sum(g.count for g in self.groups(category))

    @property
    def changed(self) -> bool:
        return any(self.by_category.get(c) for c in CATEGORIES)

    def to_dict(self) -> dict[str, Any]:
        return {
            "lines": self.lines, "requests": self.requests, "distinct": self.distinct,
            "seconds": round(self.seconds, 3), "skipped": dict(self.skipped),
            **{c: [g.to_dict() for g in self.groups(c)] for c in CATEGORIES},
        }


def _category(base: Outcome, new: Outcome) -> Category | None:
    if base.allowed and not new.allowed:
        return "newly_denied"
    if new.allowed and not base.allowed:
        return "newly_allowed"
    if not base.allowed:
        return None
    if (base.result, base.rule_id, base.credential, base.inspect) != (
            new.result, new.rule_id, new.credential, new.inspect):
        return "changed"
    return None


class _Decider:
    """Decides requests under one set, remembering missing policies."""

    def __init__(self, policy_set: PolicySet, root: str, side: str) -> None:
        self.policy_set = policy_set
        self.policies: Mapping[str, Policy] = policy_set.policies
        self.root = root
        self.side = side
        self.metering = static_metering()

    def __call__(self, policy_name: str, request: Request, models: tuple[str, ...],
                 calls: tuple[tuple[str, str | None], ...]) -> Outcome:
        policy = self.policies.get(policy_name)
        if policy is None:
            return Outcome("deny", f'policy "{policy_name}" does not exist in the {self.side} '
                                   "set; the gateway refuses tokens naming it", None, None)
        body = _body(models, calls) if request.method is not None else UNSEEN
        verdict = evaluate(self.policy_set, policy, request, body=body, metering=self.metering)
        return _outcome(verdict, self.root, request.method is None)


def _models(rec: dict[str, Any]) -> tuple[str, ...]:
    """The models an audit line shows its request reached (``models``; else the
    metered ``usage.model``; else a ``model`` field)."""
    models = rec.get("models")
    if isinstance(models, list):
        return tuple(m for m in models if isinstance(m, str))[:_MAX_SHOWN]
    usage = rec.get("usage")
    model = usage.get("model") if isinstance(usage, dict) else None
    model = model if isinstance(model, str) else rec.get("model")
    return (model,) if isinstance(model, str) else ()


def _calls(rec: dict[str, Any]) -> tuple[tuple[str, str | None], ...]:
    """The MCP calls an audit line shows the client sent (``mcp`` records not from the
    server, with a method; a body refused before any call was read shows none)."""
    records = rec.get("mcp")
    if not isinstance(records, list):
        return ()
    return tuple((r["method"], r.get("name") if isinstance(r.get("name"), str) else None)
                 for r in records[:_MAX_SHOWN]
                 if isinstance(r, dict) and isinstance(r.get("method"), str)
                 and r.get("from") is None and r.get("decision") in ("allow", "deny"))


def _body(models: tuple[str, ...], calls: tuple[tuple[str, str | None], ...]
          ) -> bytes | Unseen:
    """The body the request is decided on again: its MCP calls, or its models."""
    if calls:
        return calls_body(list(calls))
    if models:
        return json.dumps({"model": models[0], **(
            {"models": list(models[1:])} if len(models) > 1 else {})}).encode()
    return UNSEEN


def _skip(skipped: dict[str, int], why: str, n: int = 1) -> None:
    skipped[why] = skipped.get(why, 0) + n


def replay(lines: Iterable[bytes | str], base: PolicySet, head: PolicySet, *,
           base_root: str = "", head_root: str = "") -> ReplayReport:
    """Decide every recorded request under ``base`` and ``head``; group what changes."""
    started = time.perf_counter()
    report = ReplayReport()
    skipped = report.skipped
    counts: dict[tuple[Any, ...], int] = {}
    first: dict[tuple[Any, ...], Any] = {}
    loads = json.loads
    n_lines = 0
    for raw in lines:
        n_lines += 1
        try:
            rec = loads(raw)
        except ValueError:
            if raw.strip():
                _skip(skipped, "unreadable (not JSON)")
            else:
                n_lines -= 1
            continue
        if type(rec) is not dict:
            _skip(skipped, "unreadable (not JSON)")
            continue
        policy = rec.get("policy")
        host = rec.get("host")
        if not policy or not host:
            _skip(skipped, "without policy or host")
            continue
        method = rec.get("method")
        n = rec.get("count", 1)
        if method is None or method == "CONNECT":
            key: tuple[Any, ...] = (policy, None, "tcp" if rec.get("scheme") == "tcp"
                                    else "https", host, rec.get("port"), None, (), ())
        else:
            key = (policy, method, rec.get("scheme"), host, rec.get("port"), rec.get("path"),
                   _models(rec), _calls(rec))
        try:
            seen = counts.get(key)
            if seen is None:
                counts[key] = n
                first[key] = rec.get("sandbox")
            else:
                counts[key] = seen + n
        except TypeError:  # a list or object where a value belongs
            _skip(skipped, "malformed")
    report.lines = n_lines
    _decide_all(report, counts, first, _Decider(base, base_root, "base"),
                _Decider(head, head_root, "proposed"))
    report.seconds = time.perf_counter() - started
    return report


def _key_request(key: tuple[Any, ...]) -> tuple[str, Request] | str:
    """(policy, Request) for a deduplicated key, or why it is skipped."""
    policy, method, scheme, host, port, path, _, _ = key
    if not isinstance(policy, str) or not isinstance(host, str):
        return "malformed"
    try:
        host = normalize_host(host)
    except (ValueError, UnicodeError):  # HostPatternError is a ValueError
        return "malformed"
    if method is not None and not isinstance(method, str):
        return "malformed"
    if method is not None and (scheme not in ("http", "https") or not isinstance(path, str)):
        return "malformed"
    if port is None:
        port = DEFAULT_HTTP_PORT if scheme == "http" else DEFAULT_HTTPS_PORT
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        return "malformed"
    return policy, Request(method.upper() if method else None, scheme, host, port, path)


def _decide_all(report: ReplayReport, counts: dict[tuple[Any, ...], int],
                first: dict[tuple[Any, ...], Any], base: _Decider,
                head: _Decider) -> None:
    groups: dict[tuple[Category, str, str], ReplayGroup] = {}
    requests = 0
    for key, n in counts.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            _skip(report.skipped, "malformed")
            continue
        parsed = _key_request(key)
        if isinstance(parsed, str):
            _skip(report.skipped, parsed, n)
            continue
        policy, request = parsed
        if policy not in base.policies and policy not in head.policies:
            _skip(report.skipped, "policy in neither set", n)
            continue
        requests += n
        report.distinct += 1
        models, calls = key[-2], key[-1]
        model = models[0] if models else None
        before, after = base(policy, request, models, calls), head(policy, request, models, calls)
        category = _category(before, after)
        if category is None:
            continue
        group = groups.get((category, policy, request.host))
        if group is None:
            group = groups[(category, policy, request.host)] = ReplayGroup(
                category, policy, request.host)
        group.count += n
        group.distinct += 1
        sandbox = first[key]
        group.examples.append(ReplayExample(
            request.method, request.scheme, request.host, request.port, request.path, n,
            sandbox if isinstance(sandbox, str) else None, model, before, after))
        if len(group.examples) > MAX_EXAMPLES:
            group.examples.sort(key=lambda e: -e.count)
            del group.examples[MAX_EXAMPLES:]
    report.requests = requests
    for group in groups.values():
        group.examples.sort(key=lambda e: -e.count)
    for category in CATEGORIES:
        found = [g for g in groups.values() if g.category == category]
        found.sort(key=lambda g: (-g.count, g.policy, g.host))
        if found:
            report.by_category[category] = found
