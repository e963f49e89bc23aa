"""Run one policy section reader on a YAML text, as the loader does: the text composed with
its positions, a file's `Nodes` over a fresh `Problems` collector. Returns what the reader
returned and the problems it reported as `"line: message"`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import yaml
from yaml.nodes import Node

from gateway.services.policy.nodes import Nodes
from gateway.services.policy.problems import Problems

FILE = "policies/p.yaml"


def compose(text: str) -> Node:
    """``text`` as the loader composes it: nodes with their positions."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    assert node is not None
    return node


def read(reader: Callable[..., Any], text: str, *args: Any, preset: bool = False,
         **kwargs: Any) -> tuple[Any, list[str]]:
    """``reader(nodes, node, *args, **kwargs)`` on ``text``, and its problems (all in
    ``FILE``)."""
    problems = Problems()
    result = reader(Nodes(FILE, problems, preset=preset), compose(text), *args, **kwargs)
    assert all(file == FILE for file, _, _ in problems.errors)
    return result, [f"{line}: {message}" for _, line, message in problems.errors]
