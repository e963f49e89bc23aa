"""A multipart body split as its reader splits it (`core/dlp/multipart.py`): the
scanner reads each part by its own name, type and coding."""

from __future__ import annotations

import base64

import pytest

from gateway.core.dlp.decoding import Unreadable
from gateway.core.dlp.multipart import Part, StreamedParts, as_sent, boundary, outside, parts


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


def _part(head: bytes, content: bytes, delimiter: bytes = b"--XyZ") -> bytes:
    return (delimiter + b"\r\nContent-Disposition: form-data; name=\"f\"" + head +
            b"\r\n\r\n" + content + b"\r\n" + delimiter + b"--\r\n")


@pytest.mark.parametrize(("transfer", "content"), [
    ("quoted-printable", b"token =67hp_x=\r\nyz"),  # (=67 is g; a soft break)
    ("base64", base64.encodebytes(b"token ghp_xyz " * 8)),  # (76-character lines)
    ("Base64", base64.encodebytes(b"token ghp_xyz " * 8)),
    ("7bit", b"token ghp_xyz"),
])
def test_a_parts_transfer_encoding_is_undone(transfer: str, content: bytes) -> None:
    body = _part(b"\r\nContent-Transfer-Encoding: " + transfer.encode(), content)
    (part,) = parts(body, b"--XyZ")
    assert b"token ghp_xy" in as_sent(part)


@pytest.mark.parametrize(("head", "refused"), [
    (b"\r\nContent-Encoding: gzip", "content coding 'gzip'"),
    (b"\r\nContent-Encoding: identity\r\nContent-Encoding: br", "content coding 'br'"),
    (b"\r\ncontent-transfer-encoding: quoted-printable", "transfer encoding"),
    (b"\r\nContent-Transfer-Encoding: base64", "transfer encoding"),
    (b"\r\nContent-Type: text/plain; charset=utf-16le", "charset"),
    (b"\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Encoding: identity", None),
    (b"\r\nContent-Transfer-Encoding: binary", None),
])
def test_a_streamed_parts_head_is_read_at_every_cut(head: bytes, refused: str | None) -> None:
    """Fed in pieces cut anywhere (a delimiter or a head across pieces), the part's head
    is read once whole: what a stream read as text cannot undo is refused."""
    body = _part(b"", b"x" * 300) + _part(head, b"content")
    for cut in [1, 2, 3, 5, 8, 13, 40, 333, len(body)]:
        stream = StreamedParts(b"--XyZ")
        try:
            for at in range(0, len(body), cut):
                stream.feed(body[at:at + cut])
        except Unreadable as exc:
            assert refused is not None and refused in str(exc), (cut, exc)
        else:
            assert refused is None, cut


def test_a_streamed_parts_head_has_a_bound() -> None:
    stream = StreamedParts(b"--b")
    stream.feed(b"--b\r\nX-A: " + b"a" * 8000)
    with pytest.raises(Unreadable, match="head is longer"):
        stream.feed(b"a" * 9000)


def test_a_base64_part_that_does_not_decode_is_unreadable() -> None:
    """Not an exception out of the scan (binascii.Error: a 500): the reason says so."""
    body = _part(b"\r\nContent-Transfer-Encoding: base64", b"abc")
    (part,) = parts(body, b"--XyZ")
    with pytest.raises(Unreadable, match="base64 does not decode"):
        as_sent(part)
