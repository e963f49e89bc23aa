"""A file's nodes read with their positions (`nodes.Nodes`), and the load's shared problems
collector (`problems.Problems`): what every section reader's errors rest on."""

from __future__ import annotations

import pytest

from gateway.services.policy.nodes import Nodes
from gateway.services.policy.problems import PolicyError, Problems
from tests.helpers.policy_yaml import compose

FILE = "policies/p.yaml"  # (as the loader names a file: <directory>/<file>)


def nodes() -> Nodes:
    return Nodes(FILE, Problems())


def said(reader: Nodes) -> list[str]:
    return [f"{file}:{line}: {message}" for file, line, message in reader.problems.errors]


KEYS = ("host", "ports", "methods")

MAPPINGS = [
    ("{host: a, ports: [1]}", ["host", "ports"], []),
    ("host: a\nport: 1\n", ["host"],
     [f'{FILE}:2: unknown key "port" in a rule (did you mean "ports"?); known keys: host, '
      "ports, methods"]),
    ("host: a\nzzz: 1\n", ["host"],
     [f'{FILE}:2: unknown key "zzz" in a rule; known keys: host, ports, methods']),
    ("host: a\nhost: b\n", ["host"], [f'{FILE}:2: duplicate key "host" (first at line 1)']),
    ("{1: a}", [], [f"{FILE}:1: a rule keys must be strings"]),
    ("[a]", None, [f"{FILE}:1: a rule must be a mapping (key: value)"]),
    ("'" + "k" * 60 + "': 1\n", [],
     [f'{FILE}:1: unknown key "{"k" * 37}..." in a rule; known keys: host, ports, methods']),
]


@pytest.mark.parametrize(("text", "keys", "problems"), MAPPINGS)
def test_a_mapping_and_its_known_keys(text: str, keys: list[str] | None,
                                      problems: list[str]) -> None:
    reader = nodes()
    found = reader.mapping(compose(text), KEYS, "a rule")
    assert (None if found is None else list(found)) == keys
    assert said(reader) == problems


SCALARS = [
    ("string", "a", "a", []),
    ("string", "''", None, [f"{FILE}:1: x must be a non-empty string"]),
    ("string", "5", None, [f"{FILE}:1: x must be a non-empty string"]),
    ("string", "[a]", None, [f"{FILE}:1: x must be a non-empty string"]),
    ("boolean", "true", True, []),
    ("boolean", "no", False, []),
    ("boolean", "maybe", None, [f"{FILE}:1: x must be true or false"]),
    ("string_list", "[a, b]", [("a", 1), ("b", 1)], []),
    ("string_list", "- a\n- 7\n- b\n", [("a", 1), ("b", 3)],
     [f"{FILE}:2: each entry of x must be a non-empty string"]),
    ("string_list", "a", None, [f'{FILE}:1: x must be a list, e.g. x: ["..."]']),
]


@pytest.mark.parametrize(("method", "text", "value", "problems"), SCALARS)
def test_values(method: str, text: str, value: object, problems: list[str]) -> None:
    reader = nodes()
    found = getattr(reader, method)(compose(text), "x")
    if method == "string_list" and found is not None:  # (value, node): the node's line
        found = [(v, reader.line(node)) for v, node in found]
    assert found == value
    assert said(reader) == problems


@pytest.mark.parametrize(("text", "empty"), [("~", True), ("''", False), ("[]", False)])
def test_nothing_after_a_key(text: str, empty: bool) -> None:
    assert nodes().is_empty(compose(text)) is empty


def test_positions() -> None:
    node = compose("a: 1\nb:\n  c: 2\n")
    reader = nodes()
    inner = node.value[1][1]
    assert (reader.line(inner), reader.where(inner), reader.line(None)) == (3, f"{FILE}:3", 1)


def test_every_problem_of_a_load_is_said_at_once_in_file_and_line_order() -> None:
    problems = Problems()
    problems.raise_any()  # (none: nothing raised)
    Nodes("b.yaml", problems).err(compose("\n\nx"), "third line of b")
    Nodes("a.yaml", problems).err(None, "first line of a")
    problems.add("b.yaml", 1, "first line of b")
    problems.add("b.yaml", 1, "first line of b")  # (said once)
    with pytest.raises(PolicyError) as info:
        problems.raise_any()
    assert info.value.errors == ["b.yaml:1: first line of b", "b.yaml:3: third line of b",
                                 "a.yaml:1: first line of a"]
