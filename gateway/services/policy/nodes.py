"""One policy file's YAML nodes read with their positions: the helpers every section reader
takes (a mapping's known keys, strings, lists, booleans), each problem reported to the
load's shared collector as ``file:line: message``."""

from __future__ import annotations

from typing import Any

from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from gateway.services.policy.problems import KEY_SHOWN, Problems, shown, suggest

__all__ = ["Keys", "Nodes"]

Keys = dict[str, tuple[Node, Node]]  # a mapping's known keys: key node, value node


class Nodes:
    """The nodes of ``file`` (``preset``: a shipped agent preset, see policy/agents) and
    the ``problems`` collector of the load reading it."""

    def __init__(self, file: str, problems: Problems, *, preset: bool = False) -> None:
        self.file = file
        self.problems = problems
        self.preset = preset
        self._constructor = SafeConstructor()

    def err(self, node: Node | None, message: str) -> None:
        """A problem at ``node``'s line (line 1 without a node)."""
        self.problems.add(self.file, self.line(node), message)

    @staticmethod
    def line(node: Node | None) -> int:
        return node.start_mark.line + 1 if node is not None else 1

    def where(self, node: Node) -> str:
        """``file:line`` of ``node``, as a rule's or credential's ``source``."""
        return f"{self.file}:{self.line(node)}"

    def scalar(self, node: Node) -> Any:
        return self._constructor.construct_object(node, deep=True)

    def mapping(self, node: Node, allowed: tuple[str, ...], what: str) -> Keys | None:
        """Keys of a mapping node with their key/value nodes; unknown keys reported."""
        if not isinstance(node, MappingNode):
            self.err(node, f"{what} must be a mapping (key: value)")
            return None
        out: Keys = {}
        for key_node, value_node in node.value:
            key = self.scalar(key_node) if isinstance(key_node, ScalarNode) else None
            if not isinstance(key, str):
                self.err(key_node, f"{what} keys must be strings")
                continue
            if key in out:
                self.err(key_node, f"duplicate key {shown(key, KEY_SHOWN)} "
                         f"(first at line {self.line(out[key][0])})")
                continue
            if key not in allowed:
                self.err(key_node, f"unknown key {shown(key, KEY_SHOWN)} in {what}"
                         f"{suggest(key, allowed)}; known keys: {', '.join(allowed)}")
                continue
            out[key] = (key_node, value_node)
        return out

    def string(self, node: Node, what: str) -> str | None:
        value = self.scalar(node) if isinstance(node, ScalarNode) else None
        if not isinstance(value, str) or not value:
            self.err(node, f"{what} must be a non-empty string")
            return None
        return value

    def string_list(self, node: Node, what: str) -> list[tuple[str, Node]] | None:
        if not isinstance(node, SequenceNode):
            self.err(node, f'{what} must be a list, e.g. {what}: ["..."]')
            return None
        items: list[tuple[str, Node]] = []
        for item in node.value:
            value = self.string(item, f"each entry of {what}")
            if value is not None:
                items.append((value, item))
        return items

    def boolean(self, node: Node, what: str) -> bool | None:
        value = self.scalar(node) if isinstance(node, ScalarNode) else None
        if not isinstance(value, bool):
            self.err(node, f"{what} must be true or false")
            return None
        return value

    def is_empty(self, node: Node) -> bool:
        """``key:`` with nothing after it (YAML null)."""
        return isinstance(node, ScalarNode) and self.scalar(node) is None
