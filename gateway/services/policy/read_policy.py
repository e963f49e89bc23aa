"""The policy's own keys: ``version``, ``name``, ``description`` and ``mode`` (the
``RawPolicy`` the section readers fill), ``extends``, ``tokens``, ``subjects`` and
``telemetry``."""

from __future__ import annotations

from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from gateway.core.durations import parse_duration
from gateway.core.policy.model import Mode, Subject
from gateway.services.policy.agents import PREFIX, SERVICE, TELEMETRY, variant
from gateway.services.policy.nodes import Keys, Nodes
from gateway.services.policy.problems import quoted, shown
from gateway.services.policy.raw import NAME, RawPolicy

__all__ = ["POLICY_KEYS", "read_extends", "read_policy", "read_subjects", "read_telemetry",
           "read_tokens"]

POLICY_KEYS = ("version", "name", "description", "mode", "extends", "egress", "credentials",
               "budgets", "tokens", "subjects", "ask", "dlp", "telemetry")


def read_policy(nodes: Nodes, node: Node, keys: Keys) -> RawPolicy:
    """The policy ``node`` (its ``keys`` read) with its version checked, its name (or
    where it is, if it has no valid one) and its mode; its sections still empty."""
    if "version" not in keys:
        nodes.err(node, "missing version; add version: v1")
    else:
        version_node = keys["version"][1]
        version = nodes.scalar(version_node) if isinstance(version_node, ScalarNode) else None
        if version != "v1":
            nodes.err(version_node, f"unsupported version {quoted(version)}; use version: v1")
    name: str | None = None
    if "name" not in keys:
        nodes.err(node, "missing name; add name: <policy name>")
    else:
        name_node = keys["name"][1]
        name = nodes.string(name_node, "name")
        if name is not None and not NAME.fullmatch(name) and not (
                nodes.preset and name.startswith((PREFIX, SERVICE))):
            nodes.err(name_node, f'invalid policy name {shown(name)}; use letters, digits, ".", '
                      '"_", "-"')
            name = None
    if "description" in keys:
        nodes.string(keys["description"][1], "description")
    mode: Mode = "enforce"
    if "mode" in keys:
        mode_node = keys["mode"][1]
        value = nodes.scalar(mode_node) if isinstance(mode_node, ScalarNode) else None
        if value in ("report", "learn"):
            mode = "learn" if value == "learn" else "report"
        elif value != "enforce":
            nodes.err(mode_node, f"invalid mode {quoted(value)}; use enforce, report or learn")
    line = nodes.line(node)
    return RawPolicy(name=name or f"<unnamed policy at {nodes.file}:{line}>", mode=mode,
                     file=nodes.file, line=line, named=name is not None)


def read_extends(nodes: Nodes, node: Node) -> list[tuple[str, int]]:
    """Policy names, or an agent preset with its switch: ``{agent/codex: {telemetry:
    allow}}`` (see policy/agents), each with its line."""
    if not isinstance(node, SequenceNode):
        nodes.err(node, 'extends must be a list, e.g. extends: ["base"]')
        return []
    items: list[tuple[str, int]] = []
    for item in node.value:
        if isinstance(item, MappingNode) and len(item.value) == 1:
            key_node, options = item.value[0]
            agent = nodes.scalar(key_node) if isinstance(key_node, ScalarNode) else None
            if not isinstance(agent, str) or not agent.startswith(PREFIX):
                nodes.err(item, "only an agent preset takes options in extends "
                          "(- agent/codex: {telemetry: allow})")
                continue
            keys = nodes.mapping(options, ("telemetry",), "agent preset options")
            telemetry = "deny"
            if keys and "telemetry" in keys:
                value_node = keys["telemetry"][1]
                value = (nodes.scalar(value_node) if isinstance(value_node, ScalarNode)
                         else None)
                if value not in TELEMETRY:
                    nodes.err(value_node, f"invalid telemetry {quoted(value)}; use deny or allow")
                    continue
                telemetry = value
            items.append((variant(agent, telemetry), nodes.line(item)))
            continue
        name = nodes.string(item, "extends item")
        if name is not None:
            items.append((name, nodes.line(item)))
    return items


def read_tokens(nodes: Nodes, node: Node) -> float | None:
    """``tokens: {ttl: 8h}``: the lifetime of this policy's tokens when the mint names
    none (capped by the gateway's tokens.max_ttl when minted)."""
    keys = nodes.mapping(node, ("ttl",), "tokens")
    if not keys or "ttl" not in keys:
        return None
    value_node = keys["ttl"][1]
    value = nodes.scalar(value_node) if isinstance(value_node, ScalarNode) else None
    try:
        ttl = parse_duration(value, "ttl")
    except ValueError as exc:
        nodes.err(value_node, f"tokens.{exc}")
        return None
    if not 60 <= ttl <= 30 * 86400:
        nodes.err(value_node, "tokens.ttl must be from 1m to 30d")
        return None
    return ttl


def read_telemetry(nodes: Nodes, node: Node) -> bool:
    """``telemetry: {content: true}``: whether this policy's exchanges export their
    content (prompts, completions, MCP arguments and results, redacted) with their spans
    (gateway/observability/otel.py). Off unless a policy says ``true``."""
    keys = nodes.mapping(node, ("content",), "telemetry")
    if not keys or "content" not in keys:
        return False
    return nodes.boolean(keys["content"][1], "telemetry.content") is True


def read_subjects(nodes: Nodes, node: Node) -> list[Subject]:
    """``subjects: [{namespace: sandboxes, service_account: "agent-*"}]``: the Kubernetes
    workloads that may be this policy's sandboxes (globs)."""
    if not isinstance(node, SequenceNode) or not node.value:
        nodes.err(node, "subjects must be a non-empty list, e.g. subjects: "
                  "[{namespace: sandboxes, service_account: agent}]")
        return []
    subjects: list[Subject] = []
    for item in node.value:
        keys = nodes.mapping(item, ("namespace", "service_account"), "a subject")
        if keys is None:
            continue
        if "namespace" not in keys:
            nodes.err(item, "a subject needs a namespace (a glob: \"*\" for any)")
            continue
        namespace = nodes.string(keys["namespace"][1], "subjects.namespace")
        account = (nodes.string(keys["service_account"][1], "subjects.service_account")
                   if "service_account" in keys else None)
        if namespace is not None and ("service_account" not in keys or account):
            subjects.append(Subject(namespace, account))
    return subjects
