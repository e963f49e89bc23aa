"""A JSON body as detection reads it (`core/dlp/jsondoc.py`): every string and key by
its path, a key written twice read twice, paths a reader can follow."""

from __future__ import annotations

import pytest

from gateway.core.dlp.jsondoc import NOT_JSON, json_text, load, strings


def test_every_string_and_key_by_its_path_and_repeated_keys_twice() -> None:
    document = load(b'{"a": {"b": ["x", {"c": "y"}], "b": "z"}, "weird key": [1, "w"]}')
    assert sorted(strings(document, "$")) == sorted([
        ("a", "$.a (key)"), ("b", "$.a.b (key)"), ("x", "$.a.b[0]"), ("c", "$.a.b[1].c (key)"),
        ("y", "$.a.b[1].c"), ("b", "$.a.b (key)"), ("z", "$.a.b"),
        ("weird key", '$["weird key"] (key)'), ("w", '$["weird key"][1]')])


@pytest.mark.parametrize("body", [b"", b"{", b"[" * 100_000, b"\xff\xfe{}", b"{'a': 1}"])
def test_what_is_not_a_document_is_said_so(body: bytes) -> None:
    assert load(body) is NOT_JSON


def test_a_value_from_the_raw_text_reads_as_a_reader_reads_it() -> None:
    assert json_text("a\\u0041\\/b") == "aA/b"
    assert json_text('bad"') == 'bad"'  # (not a JSON string: as it is)
