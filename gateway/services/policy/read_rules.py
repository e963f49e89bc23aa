"""The egress reader: ``egress:`` as a policy file writes it, read straight into the
``Rule`` objects the matcher is compiled from (``compiled.compile_policy``), with
``mcp:`` and ``ask:`` by their own readers.

YAML to matcher: ``read_egress`` -> ``read_rule`` -> ``Rule(...)`` here; ``build.py``
keeps the rules whose credential is defined and reaches their host, adds the inherited
ones, and passes them to ``compile_policy``, which builds the ``Matcher``.
"""

from __future__ import annotations

import re

from yaml.nodes import Node, ScalarNode, SequenceNode

from gateway.core.dlp.policy import Dlp
from gateway.core.policy.ask_rule import Ask
from gateway.core.policy.hosts import HostPatternError, compile_host_pattern
from gateway.core.policy.mcp_rule import McpRule
from gateway.core.policy.methods import check_method
from gateway.core.policy.model import Action, MeteringRule, Protocol, Rule
from gateway.core.policy.paths import PathPatternError, validate_path_pattern
from gateway.services.policy.nodes import Keys, Nodes
from gateway.services.policy.problems import clipped, quoted
from gateway.services.policy.raw import RawRule
from gateway.services.policy.read_ask import read_ask
from gateway.services.policy.read_dlp import read_dlp
from gateway.services.policy.read_mcp import read_mcp

__all__ = ["ALLOW_ONLY", "read_egress", "read_metering", "read_paths", "read_rule"]

_RULE_KEYS = ("host", "ports", "methods", "paths", "credential", "inspect", "protocol", "models",
              "metering", "allow_minted_secrets", "action", "reason", "mcp", "ask",
              "unmetered", "dlp")
# A shipped agent preset's rules may also be marked `telemetry: true` (on or off by the
# switch of whoever extends the preset: see policy/agents).
_PRESET_RULE_KEYS = (*_RULE_KEYS, "telemetry")
ALLOW_ONLY = ("credential", "inspect", "models", "metering", "allow_minted_secrets", "mcp",
              "ask", "unmetered", "dlp")
_MAX_REASON = 300
_METERING_KEYS = ("required", "reserve", "max_input_tokens")
_MODEL_GLOB = re.compile(r"[!-~]{1,200}")  # printable ASCII, no spaces


def read_egress(nodes: Nodes, node: Node, policy: str) -> list[RawRule]:
    """The rules of ``egress:`` (nothing after it: none, deny all), each of ``policy``."""
    if nodes.is_empty(node):
        return []
    if not isinstance(node, SequenceNode):
        nodes.err(node, "egress must be a list of rules (- host: ...)")
        return []
    rules = [read_rule(nodes, rule_node, policy) for rule_node in node.value]
    return [rule for rule in rules if rule is not None]


def read_rule(nodes: Nodes, node: Node, policy: str) -> RawRule | None:
    """One rule of ``policy`` (None: reported).

    Longer than most functions here, on purpose: each key of a rule in turn (the order
    in which problems on one line are told), then the ``Rule`` with every field named.
    """
    keys = nodes.mapping(node, _PRESET_RULE_KEYS if nodes.preset else _RULE_KEYS,
                         "an egress rule")
    if keys is None:
        return None
    host = _host(nodes, node, keys)
    ok = host is not None
    ports: tuple[int, ...] | None = None
    if "ports" in keys:
        ports = _ports(nodes, keys["ports"][1])
        ok = ok and ports is not None
    methods: tuple[str, ...] | None = None
    if "methods" in keys:
        methods = _methods(nodes, keys["methods"][1])
        ok = ok and methods is not None
    paths: tuple[str, ...] | None = None
    if "paths" in keys:
        paths = read_paths(nodes, keys["paths"][1])
        ok = ok and paths is not None
    credential: str | None = None
    credential_node = keys["credential"][1] if "credential" in keys else node
    if "credential" in keys:
        credential = nodes.string(credential_node, "credential")
        ok = ok and credential is not None
    inspect = False
    if "inspect" in keys:
        value = nodes.boolean(keys["inspect"][1], "inspect")
        ok = ok and value is not None
        inspect = bool(value)
    protocol: Protocol = "http"
    if "protocol" in keys:
        protocol_node = keys["protocol"][1]
        name = nodes.scalar(protocol_node) if isinstance(protocol_node, ScalarNode) else None
        if name == "tcp":
            protocol = "tcp"
        elif name != "http":
            nodes.err(protocol_node, f"invalid protocol {quoted(name)}; use http or tcp")
            ok = False
    models: tuple[str, ...] | None = None
    if "models" in keys:
        models_node = keys["models"][1]
        models = _models(nodes, models_node)
        ok = ok and models is not None
        if "credential" not in keys:
            nodes.err(models_node, "models needs credential: on the same rule (the allowlist "
                      "applies to inference calls the gateway injects a key into); add "
                      "credential: or remove models")
            ok = False
    metering: MeteringRule | None = None
    unmetered: tuple[str, ...] | None = None
    allow_minted = False
    for key in ("metering", "allow_minted_secrets", "unmetered"):
        if key not in keys:
            continue
        value_node = keys[key][1]
        if key == "metering":
            metering = read_metering(nodes, value_node)
            ok = ok and metering is not None
        elif key == "unmetered":
            unmetered = read_paths(nodes, value_node, "unmetered")
            ok = ok and unmetered is not None
        else:
            allow = nodes.boolean(value_node, key)
            ok = ok and allow is not None
            allow_minted = bool(allow)
        if "credential" not in keys:
            nodes.err(value_node, f"{key} needs credential: on the same rule (it applies to "
                      "inference calls the gateway injects a key into); add credential: or "
                      f"remove {key}")
            ok = False
    mcp: McpRule | None = None
    if "mcp" in keys:
        mcp = read_mcp(nodes, keys["mcp"][1])
        ok = ok and mcp is not None
        if mcp is not None and mcp.oauth is not None and "credential" in keys:
            nodes.err(keys["credential"][0], "credential and mcp.oauth on one rule: with "
                      "mcp.oauth the gateway attaches the server's own OAuth token; remove "
                      "credential: (or oauth:)")
            ok = False
    ask: Ask | None = None
    if "ask" in keys:
        ask_node = keys["ask"][1]
        ask = read_ask(nodes, ask_node, rule=True)
        ok = ok and (ask is not None or nodes.scalar(ask_node) is False)
    dlp: Dlp | None = None
    if "dlp" in keys:
        dlp = read_dlp(nodes, keys["dlp"][1], rule=True)
        ok = ok and dlp is not None
    if protocol == "tcp":
        ok = _tcp(nodes, keys, inspect) and ok
    acted, action, reason, telemetry = _action(nodes, keys)
    if not (ok and acted) or host is None:
        return None
    rule = Rule(host=host, source=nodes.where(node), policy=policy, ports=ports,
                methods=methods, paths=paths, credential=credential, inspect=inspect,
                protocol=protocol, models=models, metering=metering,
                allow_minted_secrets=allow_minted, action=action, reason=reason, mcp=mcp,
                ask=ask, unmetered=unmetered, dlp=dlp)
    return RawRule(rule, nodes.line(credential_node), telemetry)


def _host(nodes: Nodes, node: Node, keys: Keys) -> str | None:
    """``host:``, normalised (None: reported)."""
    if "host" not in keys:
        nodes.err(node, "egress rule has no host; add host: <name>")
        return None
    host_node = keys["host"][1]
    text = nodes.string(host_node, "host")
    try:
        return compile_host_pattern(text).text if text is not None else None
    except HostPatternError as exc:
        nodes.err(host_node, clipped(str(exc)))
        return None


def _tcp(nodes: Nodes, keys: Keys, inspect: bool) -> bool:
    """``protocol: tcp`` takes nothing that needs the requests read, and needs ports."""
    ok = True
    clashing: list[str] = [k for k in ("methods", "paths", "credential", "models", "mcp",
                                       "dlp") if k in keys]
    if inspect:
        clashing.append("inspect")
    if clashing:
        nodes.err(keys["protocol"][1], f"protocol: tcp cannot be combined with "
                  f"{', '.join(clashing)} (raw TCP is not inspected); remove them or use "
                  "protocol: http")
        ok = False
    if "ports" not in keys:
        nodes.err(keys["protocol"][1], "protocol: tcp needs explicit ports (e.g. ports: [22])")
        ok = False
    return ok


def _action(nodes: Nodes, keys: Keys) -> tuple[bool, Action, str | None, bool]:
    """``action: allow | deny`` with its ``reason`` (deny only), and a preset's
    ``telemetry: true``: (ok, action, reason, telemetry)."""
    ok = True
    action: Action = "allow"
    reason: str | None = None
    if "action" in keys:
        node = keys["action"][1]
        value = nodes.scalar(node) if isinstance(node, ScalarNode) else None
        if value not in ("allow", "deny"):
            nodes.err(node, f"invalid action {quoted(value)}; use allow or deny")
            return False, action, None, False
        action = "deny" if value == "deny" else "allow"
        clashing = [k for k in ALLOW_ONLY if k in keys]
        if action == "deny" and clashing:
            nodes.err(node, f"action: deny cannot be combined with {', '.join(clashing)} "
                      "(a deny rule allows nothing); remove them")
            ok = False
    if "reason" in keys:
        node = keys["reason"][1]
        text = nodes.string(node, "reason")
        if action != "deny":
            nodes.err(node, "reason is for action: deny rules (it is what a refused request "
                      "is told); add action: deny or remove reason")
            ok = False
        elif text is not None and not 0 < len(text) <= _MAX_REASON:
            nodes.err(node, f"reason must be 1-{_MAX_REASON} characters")
            ok = False
        else:
            reason = text
    telemetry = False
    if "telemetry" in keys:
        node = keys["telemetry"][1]
        telemetry = bool(nodes.boolean(node, "telemetry"))
        if "action" in keys:
            nodes.err(node, "a telemetry rule is allowed or denied by the preset's switch: "
                      "remove action")
            ok = False
    return ok, action, reason, telemetry


def _ports(nodes: Nodes, node: Node) -> tuple[int, ...] | None:
    if not isinstance(node, SequenceNode) or not node.value:
        nodes.err(node, "ports must be a non-empty list of numbers, e.g. ports: [443]")
        return None
    ports: list[int] = []
    ok = True
    for item in node.value:
        value = nodes.scalar(item) if isinstance(item, ScalarNode) else None
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            nodes.err(item, f"invalid port {quoted(value)}; use a number from 1 to 65535")
            ok = False
        elif value not in ports:
            ports.append(value)
    return tuple(ports) if ok else None


def _methods(nodes: Nodes, node: Node) -> tuple[str, ...] | None:
    items = nodes.string_list(node, "methods")
    if items is None:
        return None
    if not items and isinstance(node, SequenceNode) and not node.value:
        nodes.err(node, "methods is empty; list methods (e.g. [GET]) or omit it for all")
        return None
    methods: list[str] = []
    ok = len(items) == len(node.value) if isinstance(node, SequenceNode) else False
    for value, item in items:
        method, problem = check_method(value)
        if method is None:
            nodes.err(item, problem or f'invalid method "{value[:32]}"')
            ok = False
        elif method not in methods:
            methods.append(method)
    return tuple(methods) if ok else None


def read_paths(nodes: Nodes, node: Node, what: str = "paths") -> tuple[str, ...] | None:
    """A list of path patterns (``paths:``, ``unmetered:``), duplicates dropped."""
    items = nodes.string_list(node, what)
    if items is None:
        return None
    if isinstance(node, SequenceNode) and not node.value:
        nodes.err(node, f'{what} is empty; list path patterns (e.g. ["/v1/**"]) or omit it')
        return None
    ok = isinstance(node, SequenceNode) and len(items) == len(node.value)
    paths: list[str] = []
    for value, item in items:
        try:
            validate_path_pattern(value)
        except PathPatternError as exc:
            nodes.err(item, clipped(str(exc)))
            ok = False
            continue
        if value not in paths:
            paths.append(value)
    return tuple(paths) if ok else None


def _models(nodes: Nodes, node: Node) -> tuple[str, ...] | None:
    items = nodes.string_list(node, "models")
    if items is None:
        return None
    if isinstance(node, SequenceNode) and not node.value:
        nodes.err(node, 'models is empty; list model globs (e.g. ["gpt-4o-mini"]) or omit it '
                  "to allow every model")
        return None
    ok = isinstance(node, SequenceNode) and len(items) == len(node.value)
    models: list[str] = []
    for value, item in items:
        if not _MODEL_GLOB.fullmatch(value):
            nodes.err(item, f"invalid model pattern {quoted(value)}; use a model name or a "
                      'glob such as "claude-sonnet-*" (printable ASCII, no spaces)')
            ok = False
        elif value not in models:
            models.append(value)
    return tuple(models) if ok else None


def read_metering(nodes: Nodes, node: Node) -> MeteringRule | None:
    """``metering: required | optional`` or ``{required: bool, reserve: tokens,
    max_input_tokens: tokens}`` (None: reported)."""
    if isinstance(node, ScalarNode):
        value = nodes.scalar(node)
        if value in ("required", "optional"):
            return MeteringRule(required=value == "required")
        nodes.err(node, f"invalid metering {str(value)[:32]!r}; use required, optional or "
                  "{required: true, reserve: <output tokens>}")
        return None
    keys = nodes.mapping(node, _METERING_KEYS, "metering")
    if keys is None:
        return None
    required: bool | None = True
    if "required" in keys:
        required = nodes.boolean(keys["required"][1], "metering.required")
    counts: dict[str, int | None] = {"reserve": None, "max_input_tokens": None}
    what = {"reserve": "output tokens (what a call without max_tokens reserves)",
            "max_input_tokens": "input tokens (the context window of a model the "
                                "catalogue does not know)"}
    for name in counts:
        if name not in keys:
            continue
        count_node = keys[name][1]
        value = nodes.scalar(count_node) if isinstance(count_node, ScalarNode) else None
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            nodes.err(count_node, f"metering.{name} must be a positive whole number of "
                      f"{what[name]}")
            return None
        counts[name] = value
    if required is None:
        return None
    return MeteringRule(required=required, reserve=counts["reserve"],
                        max_input_tokens=counts["max_input_tokens"])
