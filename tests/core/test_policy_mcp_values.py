"""MCP resource URIs and tool arguments as `mcp:` globs read them
(gateway/core/policy/mcp_values.py), table-driven: what each value is read as, and
what cannot be read one way only and is refused."""

from __future__ import annotations

import pytest

from gateway.core.policy.mcp_values import normalize_value

# (value, read as)
READ = [
    ("org/api", "org/api"),
    ("org/../evil/secret", "evil/secret"),
    ("org/./api", "org/api"),
    ("org//api", "org/api"),
    ("org/api/", "org/api/"),
    ("org/a/..", "org/"),
    ("/srv/data/../x", "/srv/x"),
    ("//srv//x", "/srv/x"),
    ("org/%61pi", "org/api"),
    ("org/%2e%2e/evil", "evil"),
    ("org/caf%C3%A9", "org/café"),
    ("100%", "100%"),
    ("", ""),
    ("repo://org/x", "repo://org/x"),
    ("repo://org/a/../b", "repo://org/b"),
    ("repo://org//a", "repo://org/a"),
    ("repo://org", "repo://org"),
    ("repo://org/", "repo://org/"),
    ("file:///etc/./passwd", "file:///etc/passwd"),
    # a query or fragment is not path: its '/' are read as %2F, its '..' resolve nothing
    ("repo://org/x?ref=a/../b", "repo://org/x?ref=a%2F..%2Fb"),
    ("repo://org/secret?/../allowed/y", "repo://org/secret?%2F..%2Fallowed%2Fy"),
    ("repo://org/x#a/b", "repo://org/x#a%2Fb"),
    ("urn:a/../b", "b"),  # (no authority: read as a path)
]


@pytest.mark.parametrize(("value", "read"), READ)
def test_values_are_read_as_a_server_reads_them(value: str, read: str) -> None:
    assert normalize_value(value) == (read, None)


# (value, a phrase of why it is refused)
REFUSED = [
    ("../org/api", "above its root"),
    ("org/../../x", "above its root"),
    ("repo://org/../../vault/key", "above its root"),
    ("repo://org/%2e%2e/x", "above its root"),
    ("/..", "above its root"),
    ("org%2fapi", "decodes to '/'"),
    ("org%2F..%2Fevil", "decodes to '/'"),
    ("org/%5c..", "decodes to '\\'"),
    ("org/%2561", "decodes to '%'"),
    ("org/%00", "decodes to NUL"),
    ("org/\x00", "NUL byte"),
    ("org\\..\\evil", "backslash"),
    ("org/%c0%ae%c0%ae", "not valid UTF-8"),
    ("org/%ff", "not valid UTF-8"),
    ("org/\ud800", "not valid UTF-8"),
    ("%%32%65%%32%65", "encoded twice"),
    ("org/..;x/evil", "hides a '.' or '..'"),
    ("org/\uff0e\uff0e/evil", "hides a '.' or '..'"),
]


@pytest.mark.parametrize(("value", "problem"), REFUSED)
def test_values_read_more_than_one_way_are_refused(value: str, problem: str) -> None:
    read, found = normalize_value(value)
    assert found is not None and problem in found, found
    assert read == value
