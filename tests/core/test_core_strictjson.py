"""The strict JSON reader (gateway/core/strictjson.py), table-driven: what every reader
reads the same way is read as Python reads it; what readers read differently is refused,
with a reason that names the problem (never the bytes)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.core import strictjson

# (case, bytes, what it reads as)
READ: list[tuple[str, bytes, Any]] = [
    ("an object", b'{"a": 1, "b": [true, false, null], "c": "x"}',
     {"a": 1, "b": [True, False, None], "c": "x"}),
    ("JSON whitespace around", b' \t\r\n{"a": 1}\r\n ', {"a": 1}),
    ("a scalar", b'"text"', "text"),
    ("nested objects, other keys", b'{"a": {"b": {"c": 1}}, "b": {"c": 2}}',
     {"a": {"b": {"c": 1}}, "b": {"c": 2}}),
    ("keys differing in case (without fold)", b'{"method": 1, "METHOD": 2}',
     {"method": 1, "METHOD": 2}),
    ("a paired surrogate escape", b'"\\ud83d\\ude00"', "\U0001F600"),
    ("an escaped backslash before ud800", b'"\\\\ud800"', "\\ud800"),
    ("UTF-8 text", '"caf\u00e9 \u2028"'.encode(), "caf\u00e9 \u2028"),
    ("the largest safe integer", b"[9007199254740991, -9007199254740991]",
     [9007199254740991, -9007199254740991]),
    ("a fraction and an exponent", b"[1.5, 1e300, -0.0]", [1.5, 1e300, -0.0]),
]

# (case, bytes, a phrase of the reason)
REFUSED: list[tuple[str, bytes, str]] = [
    ("a repeated key", b'{"a": 1, "a": 2}', "repeated"),
    ("a repeated key, deep", b'{"x": [{"y": {"a": 1, "a": 1}}]}', "repeated"),
    ("a repeated key, same value", b'{"a": 1, "a": 1}', "repeated"),
    ("NaN", b'{"a": NaN}', "NaN is not a JSON number"),
    ("Infinity", b"[Infinity]", "Infinity"),
    ("-Infinity", b"-Infinity", "-Infinity"),
    ("a number past a double", b"[1e400]", "too large for a double"),
    ("a long number past a double", b"1" + b"0" * 400 + b".0", "too large"),
    ("an integer past 2^53 - 1", b"9007199254740992", "beyond 2^53"),
    ("a negative integer past it", b'{"id": -9007199254740993}', "beyond 2^53"),
    ("a number too long to read", b"1" * 5000, "not JSON"),
    ("a lone high surrogate", b'"\\ud800"', "unpaired UTF-16 surrogate"),
    ("a lone low surrogate", b'"a\\udc00b"', "unpaired"),
    ("a high surrogate then text", b'"\\ud800x"', "unpaired"),
    ("a lone surrogate in a key", b'{"\\udfff": 1}', "unpaired"),
    ("an upper-case escape", b'"\\uD800"', "unpaired"),
    ("invalid UTF-8", b'"\xff"', "not UTF-8"),
    ("a truncated sequence", b'"\xc3"', "not UTF-8"),
    ("an encoded surrogate", b'"\xed\xa0\x80"', "not UTF-8"),
    ("an overlong encoding", b'"\xc0\xaf"', "not UTF-8"),
    ("a UTF-8 BOM", b'\xef\xbb\xbf{"a": 1}', "not JSON"),
    ("UTF-16", '{"a": 1}'.encode("utf-16"), "not UTF-8"),
    ("data after the document", b'{"a": 1} {"b": 2}', "after the JSON document"),
    ("a comma after it", b'{"a": 1},', "after the JSON document"),
    ("a NUL after it", b'{"a": 1}\x00', "after the JSON document"),
    ("a form feed after it (not JSON whitespace)", b'{"a": 1}\x0c', "after"),
    ("a control character in a string", b'"a\nb"', "not JSON"),
    ("single quotes", b"{'a': 1}", "not JSON"),
    ("a trailing comma", b'{"a": 1,}', "not JSON"),
    ("nothing", b"", "not JSON"),
    ("only whitespace", b"  \n", "not JSON"),
    ("nesting too deep", b"[" * 100_000 + b"]" * 100_000, "nesting too deep"),
]

# (case, bytes): refused only with fold
FOLDED: list[tuple[str, bytes]] = [
    ("method and METHOD", b'{"method": "ping", "METHOD": "tools/call"}'),
    ("name and Name, deep", b'{"params": {"name": "a", "Name": "b"}}'),
    ("a long s folds to s", '{"params": 1, "param\u017f": 2}'.encode()),
    ("a Kelvin sign folds to k", '{"kind": 1, "\u212aind": 2}'.encode()),
    ("sharp s folds to ss", '{"stra\u00dfe": 1, "STRASSE": 2}'.encode()),
]


@pytest.mark.parametrize(("case", "data", "doc"), READ, ids=[c[0] for c in READ])
def test_what_every_reader_reads_alike_is_read(case: str, data: bytes, doc: Any) -> None:
    assert strictjson.loads(data) == doc
    assert strictjson.loads(data, fold=not isinstance(doc, dict) or "METHOD" not in doc) == doc


@pytest.mark.parametrize(("case", "data", "why"), REFUSED, ids=[c[0] for c in REFUSED])
def test_what_readers_read_differently_is_refused(case: str, data: bytes, why: str) -> None:
    for fold in (False, True):
        with pytest.raises(strictjson.StrictJsonError) as refused:
            strictjson.loads(data, fold=fold)
        assert why in str(refused.value)
        assert len(str(refused.value)) < 120  # (a sentence, never the document)


@pytest.mark.parametrize(("case", "data"), FOLDED, ids=[c[0] for c in FOLDED])
def test_keys_differing_only_in_case_with_fold(case: str, data: bytes) -> None:
    strictjson.loads(data)
    with pytest.raises(strictjson.StrictJsonError, match="differ only in case"):
        strictjson.loads(data, fold=True)


def test_python_reads_each_refused_document_leniently() -> None:
    """The rows are real ambiguities: Python's own reader takes each of these (so a
    gateway using it would decide on one reading of several)."""
    for data in (b'{"a": 1, "a": 2}', b'{"a": NaN}', b'"\\ud800"', b"9007199254740993",
                 b'"\xed\xa0\x80"', b"[1e400]"):
        json.loads(data)


def test_dumps_is_canonical_ascii() -> None:
    doc = {"a": "caf\u00e9\u2028\x85", "b": [1, 1.5, None], "\U0001F600": True}
    out = strictjson.dumps(doc)
    assert out.isascii() and b"\n" not in out and b" " not in out
    assert strictjson.loads(out) == doc
    with pytest.raises(ValueError):
        strictjson.dumps({"a": float("nan")})
