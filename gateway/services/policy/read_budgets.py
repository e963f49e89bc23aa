"""The budgets reader: ``budgets:`` as a policy file writes them (scope, window, limits,
the credentials they count), read into ``Budget`` objects. Which credentials exist and
which budgets a policy inherits is checked across files (``build.py``)."""

from __future__ import annotations

import math
from typing import Literal

from yaml.nodes import Node, ScalarNode, SequenceNode

from gateway.core.durations import parse_duration
from gateway.core.policy.model import Budget, BudgetScope
from gateway.services.policy.nodes import Keys, Nodes
from gateway.services.policy.problems import clipped, quoted, shown
from gateway.services.policy.raw import NAME, RawBudget

__all__ = ["read_budget", "read_budgets"]

_BUDGET_KEYS = ("name", "per", "window", "tokens", "requests", "cost_usd", "credentials",
                "description")
_LIMITS = ("tokens", "requests", "cost_usd")
_MIN_WINDOW = 60


def read_budgets(nodes: Nodes, node: Node, policy: str) -> list[RawBudget]:
    """The budgets of ``policy`` (its name, ``""`` if it has none), names unique."""
    if nodes.is_empty(node):
        return []
    if not isinstance(node, SequenceNode):
        nodes.err(node, "budgets must be a list (- name: ..., per: ..., window: ...)")
        return []
    budgets: list[RawBudget] = []
    seen: dict[str, int] = {}
    for item in node.value:
        raw = read_budget(nodes, item, policy)
        if raw is None:
            continue
        name = raw.budget.name
        if name in seen:
            nodes.err(item, f'duplicate budget "{name}" (first at line {seen[name]}); '
                      "budget names must be unique within a policy")
            continue
        seen[name] = raw.line
        budgets.append(raw)
    return budgets


def read_budget(nodes: Nodes, node: Node, policy: str) -> RawBudget | None:
    """One budget (None: reported)."""
    keys = nodes.mapping(node, _BUDGET_KEYS, "a budget")
    if keys is None:
        return None
    ok = True
    name: str | None = None
    if "name" not in keys:
        nodes.err(node, "budget has no name; add name: <budget name>")
        ok = False
    else:
        name = nodes.string(keys["name"][1], "name")
        if name is not None and not NAME.fullmatch(name):
            nodes.err(keys["name"][1], f"invalid budget name {shown(name)}; use letters, "
                      'digits, ".", "_", "-"')
            name = None
        ok = ok and name is not None
    per = _per(nodes, node, keys)
    ok = ok and per is not None
    window: int | Literal["month"] | None = None
    window_text = ""
    if "window" not in keys:
        nodes.err(node, "budget has no window; add e.g. window: 24h (or month)")
        ok = False
    else:
        window, window_text = _window(nodes, keys["window"][1])
        ok = ok and window is not None
    limits: dict[str, int | float] = {}
    for key in _LIMITS:
        if key not in keys:
            continue
        value_node = keys[key][1]
        value = nodes.scalar(value_node) if isinstance(value_node, ScalarNode) else None
        whole = isinstance(value, int) and not isinstance(value, bool)
        real = key == "cost_usd" and isinstance(value, float) and math.isfinite(value)
        number: int | float | None = value if whole or real else None
        if number is None or number <= 0:
            kind = "a positive number" if key == "cost_usd" else "a positive whole number"
            nodes.err(value_node, f"{key} must be {kind}, got {quoted(value)}")
            ok = False
        else:
            limits[key] = number
    if not any(k in keys for k in _LIMITS):
        nodes.err(node, "budget sets no limit; add tokens:, requests: or cost_usd:")
        ok = False
    credentials: list[tuple[str, Node]] = []
    if "credentials" in keys:
        cred_node = keys["credentials"][1]
        items = nodes.string_list(cred_node, "credentials")
        if items is None or (isinstance(cred_node, SequenceNode) and not cred_node.value):
            if items is not None:
                nodes.err(cred_node, "credentials is empty; list credential names or omit it "
                          "for every credential of the policy")
            ok = False
        else:
            credentials = items
    if "description" in keys:
        nodes.string(keys["description"][1], "description")
    if not ok or name is None or per is None or window is None:
        return None
    tokens, requests, cost = (limits.get(k) for k in _LIMITS)
    budget = Budget(
        name=name, per=per, window=window, window_text=window_text,
        tokens=int(tokens) if tokens is not None else None,
        requests=int(requests) if requests is not None else None,
        cost_usd=float(cost) if cost is not None else None,
        credentials=tuple(dict.fromkeys(c for c, _ in credentials)) or None,
        source=nodes.where(node), policy=policy,
    )
    return RawBudget(budget, nodes.line(node),
                     tuple((c, nodes.line(item)) for c, item in credentials))


def _per(nodes: Nodes, node: Node, keys: Keys) -> BudgetScope | None:
    """``per: sandbox`` (each sandbox its own allowance) or ``per: policy``."""
    if "per" not in keys:
        nodes.err(node, "budget has no per; add per: sandbox (each sandbox its own "
                  "allowance) or per: policy (one allowance for all its sandboxes)")
        return None
    per_node = keys["per"][1]
    value = nodes.scalar(per_node) if isinstance(per_node, ScalarNode) else None
    if value not in ("sandbox", "policy"):
        nodes.err(per_node, f"invalid per {quoted(value)}; use sandbox or policy")
        return None
    return "policy" if value == "policy" else "sandbox"


def _window(nodes: Nodes, node: Node) -> tuple[int | Literal["month"] | None, str]:
    """``window: 24h`` (whole seconds, at least 1m) or ``month``, and its text."""
    value = nodes.scalar(node) if isinstance(node, ScalarNode) else None
    text = str(value)
    if value == "month":
        return "month", text
    try:
        seconds = parse_duration(value, "window")
    except ValueError as exc:
        nodes.err(node, f"{clipped(str(exc))}, or month")
        return None, text
    if seconds < _MIN_WINDOW or seconds != int(seconds):
        nodes.err(node, f"window {quoted(text)} must be whole seconds, at least 1m")
        return None, text
    return int(seconds), text
