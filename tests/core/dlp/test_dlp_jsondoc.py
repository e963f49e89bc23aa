"""A JSON body as detection reads it (`core/dlp/jsondoc.py`): every string and key by
its path, a key written twice read twice, paths a reader can follow."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.sanitized import run_sanitized

from gateway.core.dlp.jsondoc import NATIVE, NOT_JSON, joined, json_text, load, strings, texts


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


def test_strings_are_in_document_order() -> None:
    """Keys before their values, an object's pairs and an array's items in the order
    written (the C reading, `joined`, reads them so)."""
    document = load(b'{"a": ["x", {"c": "y"}], "b": "z", "a": "w"}')
    assert texts(document) == ["a", "x", "c", "y", "b", "z", "a", "w"]
    assert [p for _, p in strings(document, "$")] == [
        "$.a (key)", "$.a[0]", "$.a[1].c (key)", "$.a[1].c", "$.b (key)", "$.b",
        "$.a (key)", "$.a"]


# -- the C reading (`_jsontext.c`): json's answer, or none ------------------------------

native = pytest.mark.skipif(not NATIVE, reason="_jsontext.c not built (no C compiler)")


def _python(body: bytes) -> str | None:
    document = load(body)
    return None if document is NOT_JSON else "\n".join(texts(document))


EDGES = [  # (body, whether the C reading takes it)
    (b'"plain"', True), (b' \t\r\n{"a" : [ "b" , 1 ] }\n ', True), (b"[]", True),
    (b"{}", True), (b'[NaN, Infinity, -Infinity, true, false, null, -0, 1.5e-3, 2E+9]', True),
    (b'["\\ud83d\\ude00", "\\ud83d", "\\ude00", "\\ud83d\\u0041", "\\ud83dx\\ude00"]', True),
    (b'["\\"\\\\\\/\\b\\f\\n\\r\\t\\u0041\\u00e9\\u2014"]', True),
    ('["é—😀", "\x7f"]'.encode(), True), (b'{"a": 1, "a": "dup"}', True),
    (b'["a\x01"]', False), (b'["a\x1f"]', False), (b'["\\x"]', False),
    (b'["\\u12G4"]', False), (b'["\\ud83d\\uZZZZ"]', False), (b'["\\u12"]', False),
    (b"", False), (b"   ", False), (b"[1,]", False), (b'{"a":1,}', False),
    (b"{'a': 1}", False), (b"[1] x", False), (b"[01]", False), (b"[1.]", False),
    (b"[.5]", False), (b"[1e]", False), (b"[+1]", False), (b"[-]", False), (b"[tru]", False),
    (b'{"a" 1}', False), (b"{1: 2}", False), (b'["a"', False), (b'"abc', False),
    (b"\xef\xbb\xbf[]", False), ('["a"]'.encode("utf-16"), False),
    ('["a"]'.encode("utf-16-le"), False), (b'["\xff"]', False), (b'["\xc0\x80"]', False),
    (b'["\xed\xa0\x80"]', False), (b'["\xf4\x90\x80\x80"]', False), (b'["\xe2\x80"]', False),
    (b"[" * 257 + b"]" * 257, True), (b"[" * 300 + b"]" * 300, False),
    (b"[" + b"1" * 4000 + b"]", True), (b"[" + b"1" * 4001 + b"]", False),
    (b"[" + b"1" * 5000 + b"]", False),
]


@native
@pytest.mark.parametrize(("body", "taken"), EDGES)
def test_the_c_reading_takes_what_json_reads_the_same(body: bytes, taken: bool) -> None:
    """Where the C reading answers, json reads the same strings; what it declines
    (None) json decides (a lone surrogate escape kept, a pair made one character, the
    strict grammar's refusals, another encoding, nesting and number lengths past its
    bounds)."""
    from gateway.core.dlp import _jsontext  # type: ignore[attr-defined]

    found = _jsontext.texts(body)
    assert (found is not None) is taken
    if found is not None:
        assert found == _python(body)
    assert joined(body) == _python(body)


def _documents(seed: int, count: int) -> list[bytes]:
    """JSON documents of every kind of value, in both encodings of non-ASCII, indented
    or not, and damaged copies of them (bytes changed, cut, dropped, inserted)."""
    import json
    import random

    r = random.Random(seed)
    chars = ["a", "Z", "0", " ", '"', "\\", "/", "\n", "\x00", "\x1f", "\x7f", "é", "\u07ff",
             "\u0800", "\u2014", "\uffff", "\ud800", "\udbff", "\udc00", "\udfff", "\U00010000",
             "\U0001f600", "\U0010ffff", "\ufeff"]

    def text() -> str:
        return "".join(r.choice(chars) for _ in range(r.randrange(8)))

    def value(depth: int) -> object:
        kind = r.randrange(8 if depth < 6 else 4)
        if kind in (0, 1):
            return text()
        if kind == 2:
            return r.choice([0, -1, 1.5, 1e300, -0.0, 10**30, float("nan"), float("inf"),
                             float("-inf"), True, False, None])
        if kind == 3:
            return r.randrange(1000)
        if kind in (4, 5):
            return [value(depth + 1) for _ in range(r.randrange(4))]
        return {text(): value(depth + 1) for _ in range(r.randrange(4))}

    out = []
    while len(out) < count:
        raw = json.dumps(value(0), ensure_ascii=r.random() < 0.5,
                         indent=r.choice([None, 1, "\t"]))
        body = bytearray(raw.encode("utf-8", "surrogatepass"))
        out.append(bytes(body))
        for _ in range(r.randrange(1, 4)):
            if not body:
                break
            at = r.randrange(len(body))
            op = r.randrange(4)
            if op == 0:
                body[at] = r.randrange(256)
            elif op == 1:
                del body[at]
            elif op == 2:
                body.insert(at, r.choice(b'"\\{}[],: \tuDdE0e.-+1nN'))
            else:
                del body[at:]
        out.append(bytes(body))
    return out


@native
def test_the_c_reading_against_json_over_random_documents() -> None:
    """60,000 documents and damaged copies: the C reading is json's answer or none,
    and it declines no document json reads that is UTF-8 without a surrogate or a
    byte-order mark (its fast path stays the usual one)."""
    from gateway.core.dlp import _jsontext

    taken = 0
    for body in _documents(11, 30_000):
        found = _jsontext.texts(body)
        expected = _python(body)
        if found is not None:
            taken += 1
            assert found == expected, body
        elif expected is not None:
            # (UTF-8-encoded surrogates, a byte-order mark, UTF-16/32 by a NUL up front)
            assert b"\xed" in body or body[0] >= 0xEF or b"\x00" in body[:4], body
    assert taken > 10_000  # (the damaged half mostly is not JSON)


_ASAN_RUN = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_jsontext", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
sys.path[:0] = sys.argv[2:]  # (this file's folder, and tests/ for its helpers)
from test_dlp_jsondoc import _documents
bodies = _documents(3, 3000)
memo = module.Memo(64, 1 << 16, 32)  # (small: strings let go and slots taken over)
for body in bodies:
    for cut in range(0, len(body) + 1, max(1, len(body) // 40)):
        module.texts(body[:cut])
        module.texts(bytearray(body[:cut]))
        part = body[:cut]
        for tag in (1, 2):
            found = memo.read(part, tag)
            if found is not None:
                for _, _, start, end in found[2]:
                    memo.remember(part, start, end, tag, tag == 2)
                memo.read(bytearray(part), tag)
print("clean")
"""


@native
def test_no_read_or_write_past_a_buffer_under_address_sanitizer(tmp_path: Path) -> None:
    """The C reading built with AddressSanitizer and UBSan, over documents, damaged
    copies and every cut of them, each in a buffer of exactly its size
    (PYTHONMALLOC=malloc): nothing read past a body, nothing written past the output;
    the same with a memory of strings (`Memo`: read, remembered, read again, left out)."""
    from gateway.core.dlp import jsondoc

    source = Path(jsondoc.__file__).parent / "_jsontext.c"
    here = Path(__file__).parent
    output = run_sanitized(source, tmp_path, _ASAN_RUN, str(here), str(here.parents[1]))
    assert output.strip() == "clean"
