"""A multipart body split as its reader splits it (`core/dlp/multipart.py`): the
scanner reads each part by its own name, type and coding."""

from __future__ import annotations

import pytest

from gateway.core.dlp.decoding import Unreadable
from gateway.core.dlp.multipart import Part, boundary, outside, parts


@pytest.mark.parametrize(("ctype", "delimiter"), [
    ("multipart/form-data; boundary=----abc", b"------abc"),
    ('multipart/form-data; BOUNDARY="x y"', b"--x y"),
    ("multipart/mixed;boundary=b1; charset=utf-8", b"--b1"),
    ("multipart/form-data", None),
])
def test_the_boundary_a_content_type_names(ctype: str, delimiter: bytes | None) -> None:
    assert boundary(ctype) == delimiter


def test_parts_with_their_names_types_and_codings() -> None:
    body = (b"preamble\r\n--b\r\nContent-Disposition: form-data; name=\"title\"\r\n\r\n"
            b"notes\r\n--b\r\nContent-Disposition: form-data; name=\"f\"; filename=\"e.gz\""
            b"\r\nContent-Type: Text/Plain\r\nContent-Encoding: gzip\r\n\r\n\x1f\x8b..\r\n"
            b"--b\nContent-Type: application/json\n\n{\"a\": 1}\n--b--\r\nepilogue --b\r\n")
    got = list(parts(body, b"--b"))
    assert [(p.name, p.content, p.ctype, p.coding) for p in got] == [
        ("title", b"notes", "", None),
        ("f", b"\x1f\x8b..", "Text/Plain", "gzip"),  # (as sent)
        ("#2", b'{"a": 1}', "application/json", None),  # (bare LF heads; no name)
    ]
    assert all(isinstance(p, Part) for p in got)
    assert b"Content-Disposition" in got[0].head
    assert list(parts(b"no delimiter here", b"--b")) == []



def test_a_content_type_naming_two_boundaries_is_unreadable() -> None:
    """A reader takes the first or the last: which parts it makes is not known."""
    with pytest.raises(Unreadable, match="more than one multipart boundary"):
        boundary("multipart/form-data; boundary=AAA; boundary=BBB")
    assert boundary("multipart/form-data; boundary=AAA; boundary=AAA") == b"--AAA"


def test_a_parts_coding_is_every_line_of_it() -> None:
    body = (b"--b\r\nContent-Encoding: gzip\r\nContent-Encoding: identity\r\n\r\nx\r\n"
            b"--b--\r\n")
    assert [p.coding for p in parts(body, b"--b")] == ["gzip, identity"]


@pytest.mark.parametrize(("body", "rest"), [
    (b"pre\r\n--b\r\n\r\nx\r\n--b--\r\npost", b"pre\r\n\n\r\npost"),
    (b"--b\r\n\r\nx\r\n--b--\r\n", b"\n\r\n"),
    (b"no delimiter here", b"no delimiter here"),  # (a receiver storing it keeps it all)
    (b"pre--b\r\n\r\nx", b"pre"),  # (no closing delimiter: no epilogue)
])
def test_what_lies_outside_the_parts(body: bytes, rest: bytes) -> None:
    assert outside(body, b"--b") == rest
