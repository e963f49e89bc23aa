"""gateway.core.metering.jsondoc: json.loads's answers on UTF-8 bytes (a BOM is
refused, as RFC 8259 senders must not add one)."""

from __future__ import annotations

import json

import pytest

from gateway.core.metering.jsondoc import document

DECODER = json.JSONDecoder()

GOOD = [
    b'{"a": 1}',
    b'  {"a": [1, 2, {"b": null}]}',
    b'{"a": 1}\r\n\t ',
    b"[1, 2]",
    b'"text"',
    b"12",
    '{"m": "caf\u00e9"}'.encode(),
]
BAD = [
    b"",
    b"   ",
    b'{"a": 1} x',
    b'{"a": 1}{"b": 2}',
    b'{"a": 1',
    b'{"a": "\xff"}',  # not UTF-8
    b"\xef\xbb\xbf{}",  # a BOM: not JSON text
    b'{"a": 1}\x0b',  # vertical tab: not JSON whitespace
]


@pytest.mark.parametrize("data", GOOD)
def test_documents(data: bytes) -> None:
    assert document(data, DECODER) == json.loads(data)


@pytest.mark.parametrize("data", BAD)
def test_not_documents(data: bytes) -> None:
    with pytest.raises(ValueError):
        document(data, DECODER)


def test_the_decoder_hooks_apply() -> None:
    def unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
        if len({k for k, _ in pairs}) != len(pairs):
            raise ValueError("duplicate key")
        return dict(pairs)

    strict = json.JSONDecoder(object_pairs_hook=unique)
    assert document(b'{"a": {"b": 1}}', strict) == {"a": {"b": 1}}
    with pytest.raises(ValueError):
        document(b'{"a": 1, "a": 2}', strict)
    with pytest.raises(ValueError):
        document(b' {"a": 1, "a": 2}', strict)
