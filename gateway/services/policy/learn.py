"""``sandbox-gateway policy learn``: the smallest policy that allows recorded traffic.

Audit lines (``mode: learn``, ``run --learn``, or any audit trail) of one policy go in;
a policy file comes out. The rules, in the order they are applied (docs/policies.md,
"Learning a policy", says the same for people):

1. Only lines the gateway let through are learned (decision ``allow`` or ``report``);
   refused lines (the destination check, leaks, an enforcing policy's denies) are counted
   and left out: the learned policy refuses them still.
2. A host goes to a **service preset** (``extends: [service/pypi]``...) when the preset
   allows every learned request to it and none of them used a credential (presets are
   keyless). A preset that covers no host whole is not used.
3. Every other host gets its own rules, one group per (host, port, scheme, credential):
   a tunnel seen only as a tunnel (passthrough, raw TCP) gives a host rule (``protocol:
   tcp`` for raw TCP); requests give ``methods`` and ``paths``.
4. **Paths** are generalised only where the rule stays tight: a segment that looks like an
   identifier becomes ``*`` (digits only; hex of 7 or more characters with a digit; a
   UUID; a run of 20 or more letters, digits, ``-``, ``_`` mixing letters and digits);
   other segments are kept. Then, among one group's paths sharing their first segment,
   four or more distinct ones become ``<their longest common prefix>/**`` (at least one
   fixed segment: never ``/**``). Query strings are never part of a rule (the audit line
   drops them).
5. Paths seen with the same set of methods share a rule (``methods`` that set), so a
   method seen on one path is not allowed on another.
6. **Models**: paths whose requests named a model get their own rule with ``models:``
   listing every model seen (exact names, no globs); **MCP**: a rule whose requests
   carried MCP calls gets ``mcp:`` allowing exactly the tools, resources and prompts seen.
7. **Credentials** are named on the rules whose requests used them; the original policy
   file's ``credentials``, ``tokens`` and ``subjects`` are carried over as written (so the
   names resolve), and ``budgets`` whose credentials the learned rules still inject.

Pure apart from reading the original file's text, which the caller passes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from gateway.core.policy import Request, decide
from gateway.core.policy.compiled import PolicySet
from gateway.core.policy.hosts import normalize_host
from gateway.core.policy.model import DEFAULT_HTTP_PORT, DEFAULT_HTTPS_PORT
from gateway.core.policy.paths import normalize_path

__all__ = ["FANOUT", "Learned", "generalise_paths", "id_segment", "learn", "read_lines"]

FANOUT = 4  # distinct paths under one first segment before they become `prefix/**`
_HEX = re.compile(r"[0-9a-fA-F]{7,}")
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
                   r"[0-9a-fA-F]{12}")
_TOKEN = re.compile(r"[A-Za-z0-9_-]{20,}")
_LEARNED = ("allow", "report")
_MCP_KINDS = {"tools/call": "tools", "resources/read": "resources", "prompts/get": "prompts"}


def id_segment(segment: str) -> bool:
    """Does this path segment look like an identifier (a number, a hash, a UUID, a
    token), which a rule writes as ``*``?"""
    if segment.isdigit():
        return True
    if _UUID.fullmatch(segment):
        return True
    if _HEX.fullmatch(segment) and any(c.isdigit() for c in segment):
        return True
    return bool(_TOKEN.fullmatch(segment) and any(c.isdigit() for c in segment)
                and any(c.isalpha() for c in segment))


def _shape(path: str) -> str:
    """A request path with its identifier segments as ``*`` (rule 4, first half)."""
    segments = [s for s in path.split("/") if s]
    return "/" + "/".join("*" if id_segment(s) else s for s in segments)


def generalise_paths(paths: Iterable[str]) -> list[str]:
    """Rule 4 on one group's request paths: identifiers as ``*``, then ``prefix/**`` for
    ``FANOUT`` or more distinct paths under one first segment."""
    shapes = sorted({_shape(p) for p in paths})
    by_first: dict[str, list[str]] = {}
    for shape in shapes:
        first = shape.split("/")[1] if shape != "/" else ""
        by_first.setdefault(first, []).append(shape)
    out: list[str] = []
    for first, group in by_first.items():
        if len(group) < FANOUT or not first or first == "*":
            out.extend(group)
            continue
        split = [g.split("/")[1:] for g in group]
        common: list[str] = []
        for parts in zip(*split, strict=False):
            if len(set(parts)) != 1 or parts[0] == "*":
                break
            common.append(parts[0])
        out.append("/" + "/".join(common) + "/**")
    return sorted(set(out))


@dataclass(slots=True)
class _Group:
    """What one (host, port, scheme, credential) was seen doing."""

    tunnel_only: bool = True
    tcp: bool = False
    methods: dict[str, set[str]] = field(default_factory=dict)  # path -> methods
    models: dict[str, set[str]] = field(default_factory=dict)  # path -> models
    mcp: dict[str, set[str]] = field(default_factory=dict)  # kind -> names
    count: int = 0


@dataclass(slots=True)
class Learned:
    """A learned policy: its file ``text``, the presets it extends, what was learned from
    how many lines, and the lines it was learned from (``learned``) and left out
    (``refused``), for the replay proof."""

    policy: str
    text: str
    presets: list[str]
    hosts: dict[str, str]  # host -> the preset that covers it, or "own rules"
    learned: list[dict[str, Any]]
    refused: list[dict[str, Any]]
    skipped: int = 0
    notes: list[str] = field(default_factory=list)


def read_lines(lines: Iterable[str | bytes]) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of ``lines`` and how many lines were not one."""
    out: list[dict[str, Any]] = []
    bad = 0
    for raw in lines:
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except ValueError:
            bad += 1
            continue
        if isinstance(rec, dict):
            out.append(rec)
        else:
            bad += 1
    return out, bad


def _request(rec: Mapping[str, Any]) -> Request | None:
    """The request an audit line shows (None: not enough to decide it)."""
    host, port = rec.get("host"), rec.get("port")
    if not isinstance(host, str) or not isinstance(port, int):
        return None
    method = rec.get("method")
    scheme = rec.get("scheme") if rec.get("scheme") in ("http", "https", "tcp") else "https"
    if method is None or method == "CONNECT":
        return Request(None, "tcp" if scheme == "tcp" else "https", normalize_host(host),
                       port, None)
    path = rec.get("path") if isinstance(rec.get("path"), str) else "/"
    return Request(str(method).upper(), str(scheme), normalize_host(host), port, path)


def _models(rec: Mapping[str, Any]) -> list[str]:
    models = rec.get("models")
    if isinstance(models, list):
        return [m for m in models if isinstance(m, str)]
    usage = rec.get("usage")
    model = usage.get("model") if isinstance(usage, dict) else None
    return [model] if isinstance(model, str) else []


def _mcp(rec: Mapping[str, Any]) -> list[tuple[str, str]]:
    records = rec.get("mcp")
    if not isinstance(records, list):
        return []
    return [(_MCP_KINDS[r["method"]], r["name"]) for r in records
            if isinstance(r, dict) and r.get("from") is None
            and r.get("method") in _MCP_KINDS and isinstance(r.get("name"), str)]


def _covering(presets: Mapping[str, PolicySet], host: str,
              requests: list[Request]) -> str | None:
    """The first preset (by name) allowing every one of ``requests`` to ``host``."""
    for name, policy_set in sorted(presets.items()):
        policy = policy_set.policies["learn-probe"]
        if all(decide(policy, r).result == "allow" for r in requests):
            return name
    return None


def learn(records: Iterable[dict[str, Any]], policy: str, *,
          presets: Mapping[str, PolicySet], original: str | None = None,
          description: str = "") -> Learned:
    """The learned policy ``policy`` from ``records`` (audit lines as objects; lines of
    other policies are ignored). ``presets``: a set per service preset, each holding the
    policy ``learn-probe`` that extends only it (rule 2). ``original``: the text of the
    file that defines ``policy`` now (rule 7)."""
    learned: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []
    skipped = 0
    groups: dict[tuple[str, int, str, str | None], _Group] = {}
    by_host: dict[str, list[Request]] = {}
    keyed_hosts: set[str] = set()
    for rec in records:
        if rec.get("policy") != policy:
            continue
        request = _request(rec)
        if request is None:
            skipped += 1
            continue
        if rec.get("decision") not in _LEARNED:
            refused.append(rec)
            continue
        learned.append(rec)
        credential = rec.get("credential") if isinstance(rec.get("credential"), str) else None
        if credential:
            keyed_hosts.add(request.host)
        by_host.setdefault(request.host, []).append(request)
        scheme = "tcp" if request.scheme == "tcp" else (
            "http" if request.scheme == "http" else "https")
        group = groups.setdefault((request.host, request.port, scheme, credential), _Group())
        group.count += int(rec.get("count", 1)) if isinstance(rec.get("count", 1), int) else 1
        if request.method is None:
            group.tcp = group.tcp or request.scheme == "tcp"
            continue
        group.tunnel_only = False
        path, problem = normalize_path(request.path or "/")
        if problem is not None:
            skipped += 1
            continue
        group.methods.setdefault(path, set()).add(request.method)
        models = _models(rec)
        if models:
            group.models.setdefault(path, set()).update(models)
        for kind, name in _mcp(rec):
            group.mcp.setdefault(kind, set()).add(name)

    hosts: dict[str, str] = {}
    used: list[str] = []
    for host in sorted(by_host):
        preset = None if host in keyed_hosts else _covering(presets, host, by_host[host])
        hosts[host] = preset or "own rules"
        if preset is not None and preset not in used:
            used.append(preset)

    rules: list[str] = []
    injected: set[str] = set()
    for (host, port, scheme, credential), group in sorted(
            groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], kv[0][3] or "")):
        if hosts[host] != "own rules":
            continue
        if credential:
            injected.add(credential)
        rules.extend(_rules(host, port, scheme, credential, group))

    notes: list[str] = []
    carried = _carried(original, policy, injected, notes)
    text = _render(policy, description, used, rules, carried)
    return Learned(policy, text, used, hosts, learned, refused, skipped, notes)


def _rules(host: str, port: int, scheme: str, credential: str | None,
           group: _Group) -> list[str]:
    """The rules of one group (rules 3 to 6), as YAML list items."""
    default = DEFAULT_HTTP_PORT if scheme == "http" else DEFAULT_HTTPS_PORT
    head = [f"  - host: {_q(host)}"]
    if port != default or scheme == "tcp":
        head.append(f"    ports: [{port}]")
    if scheme == "tcp":
        return ["\n".join([*head, "    protocol: tcp"])]
    if group.tunnel_only:
        return ["\n".join(head + ([f"    credential: {_q(credential)}"] if credential else []))]
    # paths by (methods seen, models named?)
    buckets: dict[tuple[tuple[str, ...], bool], list[str]] = {}
    for path, seen in group.methods.items():
        buckets.setdefault((tuple(sorted(seen)), path in group.models), []).append(path)
    out: list[str] = []
    for (methods, with_models), paths in sorted(buckets.items()):
        lines = [*head, f"    methods: {_flow(methods)}",
                 f"    paths: {_flow(generalise_paths(paths))}"]
        if credential:
            lines.append(f"    credential: {_q(credential)}")
        if with_models:
            models = sorted(set().union(*(group.models[p] for p in paths)))
            lines.append(f"    models: {_flow(models)}")
        if group.mcp:
            lines.append("    mcp:")
            for kind in ("tools", "resources", "prompts"):
                if kind in group.mcp:
                    lines.append(f"      {kind}: {{allow: {_flow(sorted(group.mcp[kind]))}}}")
        out.append("\n".join(lines))
    return out


def _q(value: str) -> str:
    """A YAML scalar for ``value``: plain where that reads back the same, else quoted."""
    plain = re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]*", value) is not None
    return value if plain and yaml.safe_load(value) == value else json.dumps(value)


def _flow(items: Iterable[str]) -> str:
    return "[" + ", ".join(_q(i) for i in items) + "]"


def _carried(original: str | None, policy: str, injected: set[str],
             notes: list[str]) -> dict[str, Any]:
    """Rule 7: what the original file's policy document keeps in the learned one."""
    if not original:
        return {}
    try:
        docs = [d for d in yaml.safe_load_all(original) if isinstance(d, dict)]
    except yaml.YAMLError:
        notes.append("the original policy file is not readable YAML: nothing carried over")
        return {}
    doc = next((d for d in docs if d.get("name") == policy), None)
    if doc is None:
        return {}
    out = {k: doc[k] for k in ("credentials", "tokens", "subjects") if k in doc}
    budgets = []
    for budget in doc.get("budgets") or []:
        names = budget.get("credentials") if isinstance(budget, dict) else None
        if (names is None and injected) or (isinstance(names, list) and names
                                            and set(names) <= injected):
            budgets.append(budget)
        else:
            notes.append(f"budget {budget.get('name') if isinstance(budget, dict) else '?'} "
                         "left out: the learned rules inject none of its credentials")
    if budgets:
        out["budgets"] = budgets
    return out


def _render(policy: str, description: str, presets: list[str], rules: list[str],
            carried: Mapping[str, Any]) -> str:
    lines = ["version: v1", f"name: {_q(policy)}"]
    if description:
        lines.append(f"description: {json.dumps(description)}")
    if presets:
        lines.append(f"extends: {_flow(sorted(presets))}")
    lines.append("egress:" if rules else "egress: []")
    lines.extend(rules)
    text = "\n".join(lines) + "\n"
    if carried:
        text += yaml.safe_dump(dict(carried), sort_keys=False, default_flow_style=False)
    return text
