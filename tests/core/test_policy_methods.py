"""Which names a rule's `methods:` may list (pure, table-driven). The loader's table in
`test_policy_loader.py` shows the same messages at a file's line."""

from __future__ import annotations

import pytest

from gateway.core.policy.methods import EXTENSION_METHODS, STANDARD_METHODS, check_method

ACCEPTED = [
    ("GET", "GET"),
    ("get", "GET"),  # a standard method in any case
    ("Patch", "PATCH"),
    ("delete", "DELETE"),
    ("CONNECT", "CONNECT"),
    ("PROPFIND", "PROPFIND"),  # a registered extension, in uppercase
    ("QUERY", "QUERY"),
    ("VERSION-CONTROL", "VERSION-CONTROL"),
]


@pytest.mark.parametrize(("value", "method"), ACCEPTED)
def test_a_known_method_is_matched_as_written_on_the_wire(value: str, method: str) -> None:
    assert check_method(value) == (method, None)


REFUSED = [
    # Extensions are case-sensitive on the wire: a lower-case one is another method.
    ("propfind", 'method "propfind" must be written in uppercase (PROPFIND): HTTP methods '
                 "are case-sensitive"),
    ("Mkcol", 'method "Mkcol" must be written in uppercase (MKCOL)'),
    ("*", 'invalid method "*"; omit methods to allow every method'),
    ("GTE", 'unknown method "GTE"; did you mean GET? use a standard HTTP method'),
    ("PSOT", "did you mean POST?"),
    ("PROPFINDX", "did you mean PROPFIND?"),
    ("PRI", 'unknown method "PRI"; use a standard'),  # the HTTP/2 preface, never a request
    ("FROBNICATE", 'unknown method "FROBNICATE"; use a standard HTTP method'),
    ("", 'unknown method ""'),
    ("G E T", 'unknown method "G E T"'),
    ("X" * 100, f'unknown method "{"X" * 32}"; '),  # clipped in the message
]


@pytest.mark.parametrize(("value", "message"), REFUSED)
def test_anything_else_is_refused_with_what_to_write(value: str, message: str) -> None:
    method, problem = check_method(value)
    assert method is None
    assert problem is not None and message in problem
    if "unknown" in message:
        assert problem.endswith("or omit methods to allow every method")


def test_the_two_lists_are_disjoint_and_uppercase() -> None:
    assert not STANDARD_METHODS & EXTENSION_METHODS
    assert all(m == m.upper() for m in STANDARD_METHODS | EXTENSION_METHODS)
    assert "PRI" not in EXTENSION_METHODS


@pytest.mark.parametrize("method", sorted(STANDARD_METHODS | EXTENSION_METHODS))
def test_every_listed_method_is_accepted(method: str) -> None:
    assert check_method(method) == (method, None)
