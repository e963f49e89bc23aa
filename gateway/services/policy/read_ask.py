"""The `ask:` reader: a policy's ``ask: {hosts, requests, models, timeout, notify}``, a
rule's ``ask: true`` or ``ask: {timeout, notify}`` (semantics in `ask_rule.py`)."""

from __future__ import annotations

from yaml.nodes import MappingNode, Node, ScalarNode

from gateway.core.durations import parse_duration
from gateway.core.policy.ask_rule import DEFAULT_TIMEOUT, MAX_TIMEOUT, Ask
from gateway.services.policy.nodes import Nodes
from gateway.services.policy.problems import clipped
from gateway.services.policy.raw import NAME

__all__ = ["read_ask"]

_POLICY_KEYS = ("hosts", "requests", "models", "timeout", "notify")
_RULE_KEYS = ("timeout", "notify")


def read_ask(nodes: Nodes, node: Node, *, rule: bool) -> Ask | None:
    """The ``Ask`` of a policy or (``rule``) of a rule; None: none, or reported."""
    if rule and isinstance(node, ScalarNode):
        value = nodes.boolean(node, "ask")
        return None if value is None else Ask() if value else None
    if not isinstance(node, MappingNode):
        nodes.err(node, "ask must be a mapping, e.g. ask: {hosts: true, timeout: 60s}"
                  if not rule else "ask must be true or {timeout: 60s, notify: [...]}")
        return None
    keys = nodes.mapping(node, _RULE_KEYS if rule else _POLICY_KEYS, "ask")
    if keys is None:
        return None
    ok = True
    flags: dict[str, bool] = {}
    for key in ("hosts", "requests", "models"):
        if key in keys:
            value = nodes.boolean(keys[key][1], f"ask.{key}")
            ok = ok and value is not None
            flags[key] = bool(value)
    timeout = DEFAULT_TIMEOUT
    if "timeout" in keys:
        timeout_node = keys["timeout"][1]
        try:
            timeout = parse_duration(nodes.scalar(timeout_node), "ask.timeout")
            if timeout > MAX_TIMEOUT:
                raise ValueError(f"ask.timeout: at most {MAX_TIMEOUT:g}s (a request is "
                                 "held that long)")
        except ValueError as exc:
            nodes.err(timeout_node, clipped(str(exc)))
            ok = False
    notify: tuple[str, ...] = ()
    if "notify" in keys:
        items = nodes.string_list(keys["notify"][1], "ask.notify")
        ok = ok and items is not None
        for name, item in items or []:
            if not NAME.fullmatch(name):
                nodes.err(item, f"ask.notify: {clipped(repr(name))} is not a notifier "
                          "name (letters, digits, '.', '_', '-')")
                ok = False
        notify = tuple(dict.fromkeys(v for v, _ in items or []))
    if ok and not rule and not any(flags.values()):
        nodes.err(node, "ask asks for nothing; add hosts, requests and/or models: true")
        ok = False
    if not ok:
        return None
    return Ask(hosts=flags.get("hosts", False), requests=flags.get("requests", False),
               models=flags.get("models", False), timeout=timeout, notify=notify,
               timed="timeout" in keys)
