"""Reading composed YAML nodes with their line numbers: the raw policies, rules, budgets
and credentials a file holds before they are checked against each other and compiled."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from gateway.core.policy.ask_rule import Ask
from gateway.core.policy.hosts import HostPattern
from gateway.core.policy.model import (
    Budget,
    Credential,
    Mode,
    Subject,
)
from gateway.services.policy.problems import KEY_SHOWN, shown, suggest

# A policy's, budget's or credential's name.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


@dataclass
class RawRule:
    fields: dict[str, Any]
    file: str
    line: int
    credential_node: Node | None = None
    host_pattern: HostPattern | None = None
    telemetry: bool = False  # a shipped preset's telemetry rule (see policy/agents.py)


@dataclass
class RawBudget:
    budget: Budget
    file: str
    line: int
    credential_nodes: list[tuple[str, Node]] = field(default_factory=list)


@dataclass
class RawPolicy:
    name: str
    mode: Mode
    file: str
    line: int
    named: bool = True
    extends: list[tuple[str, Node]] = field(default_factory=list)
    rules: list[RawRule] = field(default_factory=list)
    extends_line: int = 0
    budgets: list[RawBudget] = field(default_factory=list)
    token_ttl: float | None = None  # `tokens: {ttl: 8h}`: its tokens' default lifetime
    subjects: list[Subject] = field(default_factory=list)  # `subjects:` (Kubernetes)
    ask: Ask | None = None  # `ask:` (what a person may approve)


@dataclass
class CredentialDef:
    credential: Credential
    where: str


class NodeReader:
    """Walks composed YAML nodes, collecting errors with their file and line."""

    def __init__(self) -> None:
        self.errors: list[tuple[str, int, str]] = []
        self.policies: list[RawPolicy] = []
        self.credentials: dict[str, CredentialDef] = {}
        self.preset = False  # reading a shipped agent preset (policy/agents.py)
        self._constructor = SafeConstructor()

    def err(self, file: str, node: Node | None, message: str) -> None:
        line = node.start_mark.line + 1 if node is not None else 1
        self.errors.append((file, line, message))

    def scalar(self, node: Node) -> Any:
        return self._constructor.construct_object(node, deep=True)

    def mapping(
        self, file: str, node: Node, allowed: tuple[str, ...], what: str
    ) -> dict[str, tuple[Node, Node]] | None:
        """Keys of a mapping node with their key/value nodes; unknown keys reported."""
        if not isinstance(node, MappingNode):
            self.err(file, node, f"{what} must be a mapping (key: value)")
            return None
        out: dict[str, tuple[Node, Node]] = {}
        for key_node, value_node in node.value:
            key = self.scalar(key_node) if isinstance(key_node, ScalarNode) else None
            if not isinstance(key, str):
                self.err(file, key_node, f"{what} keys must be strings")
                continue
            if key in out:
                first = out[key][0].start_mark.line + 1
                self.err(file, key_node, f"duplicate key {shown(key, KEY_SHOWN)} "
                         f"(first at line {first})")
                continue
            if key not in allowed:
                self.err(
                    file,
                    key_node,
                    f"unknown key {shown(key, KEY_SHOWN)} in {what}{suggest(key, allowed)}; "
                    f"known keys: {', '.join(allowed)}",
                )
                continue
            out[key] = (key_node, value_node)
        return out

    def string(self, file: str, node: Node, what: str) -> str | None:
        value = self.scalar(node) if isinstance(node, ScalarNode) else None
        if not isinstance(value, str) or not value:
            self.err(file, node, f"{what} must be a non-empty string")
            return None
        return value

    def string_list(self, file: str, node: Node, what: str) -> list[tuple[str, Node]] | None:
        if not isinstance(node, SequenceNode):
            self.err(file, node, f'{what} must be a list, e.g. {what}: ["..."]')
            return None
        items: list[tuple[str, Node]] = []
        for item in node.value:
            value = self.string(file, item, f"each entry of {what}")
            if value is not None:
                items.append((value, item))
        return items

    def boolean(self, file: str, node: Node, what: str) -> bool | None:
        value = self.scalar(node) if isinstance(node, ScalarNode) else None
        if not isinstance(value, bool):
            self.err(file, node, f"{what} must be true or false")
            return None
        return value
