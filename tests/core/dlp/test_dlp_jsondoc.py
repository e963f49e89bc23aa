"""A JSON body as detection reads it (`core/dlp/jsondoc.py`): every string and key by
its path, a key written twice read twice, paths a reader can follow."""

from __future__ import annotations

import pytest

from gateway.core.dlp.jsondoc import NOT_JSON, json_text, load, strings, texts


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


def test_texts_are_the_strings_in_their_order() -> None:
    """`texts` (read first, without paths) lists what `strings` lists, in its order:
    the scan of one and the other's joined text is the same text."""
    import json
    import random

    r = random.Random(7)

    def node(depth: int) -> object:
        kind = r.randrange(5 if depth < 4 else 2)
        if kind == 0:
            return "".join(r.choice("ab\\n\"é") for _ in range(r.randrange(4)))
        if kind == 1:
            return r.choice([1, 2.5, None, True, False])
        if kind == 2:
            return [node(depth + 1) for _ in range(r.randrange(4))]
        return {f"k{r.randrange(3)}": node(depth + 1) for _ in range(r.randrange(4))}

    for _ in range(2_000):
        body = json.dumps(node(0)).encode()
        if r.random() < 0.3:  # (a key written twice: both pairs read)
            body = body.replace(b'"k1"', b'"k0"')
        document = load(body)
        assert texts(document) == [s for s, _ in strings(document, "$")], body
