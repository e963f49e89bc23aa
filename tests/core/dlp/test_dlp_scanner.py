"""Every detector's FAKE credential (tests/helpers/dlp_corpus.py) is found in every
place and encoding a client could put it: a header, the query, a JSON string, a form
field, a multipart part, each content coding and stacks of them, base64 and hex runs -
with its location named and a fingerprint, never the value."""

from __future__ import annotations

import base64
import gzip
import json
import re
import zlib
from collections.abc import Callable
from urllib.parse import quote, urlencode

import brotli
import pytest
import zstandard
from helpers.dlp_corpus import CORPUS, DEFAULT_CORPUS, Fake

from gateway.core.dlp import DEFAULT, DETECTORS, Finding, Location, Scanner
from gateway.core.dlp.decoding import decode_content
from gateway.services.dlp.library import build

SCANNER = Scanner(build(DETECTORS), b"test-salt")
JSON = "application/json"
BOUNDARY = "----dlp43boundary"


def _chat(text: str) -> bytes:
    return json.dumps({"model": "gpt-4o", "messages": [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Here is the file:"},
        {"role": "user", "content": f"config:\n{text}\nthanks"}]}).encode()


def _multipart(text: str) -> bytes:
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"title\"\r\n\r\nnotes\r\n"
            f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"upload\"; "
            f"filename=\"env.txt\"\r\nContent-Type: text/plain\r\n\r\n{text}\r\n"
            f"--{BOUNDARY}--\r\n").encode()


Carrier = Callable[[str], tuple[str, list[tuple[str, str]], bytes]]
MP = f"multipart/form-data; boundary={BOUNDARY}"

# name -> (method target, headers, body) and the location expected (None: not checked)
CARRIERS: dict[str, tuple[Carrier, str | None]] = {
    "header": (lambda t: ("/", [("X-Note", t.replace("\n", " "))], b""), "header X-Note"),
    "query": (lambda t: ("/up?a=1&note=" + quote(t, safe=""), [], b""),
              "query note"),
    "json": (lambda t: ("/", [("Content-Type", JSON)], _chat(t)),
             "body $.messages[2].content"),
    # the key's first character written as a JSON \u escape: a JSON reader reads the key
    "json-escaped": (lambda t: ("/", [("Content-Type", JSON)], _chat(t).replace(
        b"config:\\n" + json.dumps(t[0])[1:-1].encode(),
        b"config:\\n\\u%04x" % ord(t[0]), 1)), "body $.messages[2].content"),
    "form": (lambda t: ("/", [("Content-Type", "application/x-www-form-urlencoded")],
                        urlencode({"a": "1", "note": t}).encode()), "body form field note"),
    "multipart": (lambda t: ("/", [("Content-Type", MP)], _multipart(t)),
                  "body multipart part upload"),
    "gzip": (lambda t: ("/", [("Content-Type", JSON), ("Content-Encoding", "gzip")],
                        gzip.compress(_chat(t))), "body $.messages[2].content (in gzip)"),
    "deflate": (lambda t: ("/", [("Content-Type", JSON), ("Content-Encoding", "deflate")],
                           zlib.compress(_chat(t))), None),
    "br": (lambda t: ("/", [("Content-Type", JSON), ("Content-Encoding", "br")],
                      brotli.compress(_chat(t))), None),
    "zstd": (lambda t: ("/", [("Content-Type", JSON), ("Content-Encoding", "zstd")],
                        zstandard.ZstdCompressor().compress(_chat(t))), None),
    "gzip+br": (lambda t: ("/", [("Content-Type", JSON), ("Content-Encoding", "gzip, br")],
                           brotli.compress(gzip.compress(_chat(t)))),
                "body $.messages[2].content (in gzip, br)"),
    "base64-body": (lambda t: ("/", [("Content-Type", "text/plain")],
                               base64.b64encode(t.encode())), None),
    "base64-in-json": (lambda t: ("/", [("Content-Type", JSON)], json.dumps(
        {"file": base64.b64encode(t.encode()).decode()}).encode()), None),
    "base64url-header": (lambda t: ("/", [("X-Blob", base64.urlsafe_b64encode(
        t.encode()).decode().rstrip("="))], b""), None),
    "basic-auth-header": (lambda t: ("/", [("Authorization", "Basic " + base64.b64encode(
        b"user:" + t.encode()).decode())], b""), None),
    "hex": (lambda t: ("/", [("Content-Type", "text/plain")], t.encode().hex().encode()),
            None),
    "hex-shifted": (lambda t: ("/", [("Content-Type", "text/plain")],
                               b"k" + t.encode().hex().encode()), None),
    # base64 behind one to three other characters of the alphabet: off its alignment
    "base64-shifted": (lambda t: ("/", [("Content-Type", "text/plain")], b"x=" + b"Q9z"[
        :1 + len(t) % 3] + base64.b64encode(t.encode())), None),
    "base64-of-hex": (lambda t: ("/", [("Content-Type", "text/plain")], base64.b64encode(
        t.encode().hex().encode())), None),
}


def _case(fake: Fake, carrier: str) -> list[Finding]:
    build_request, _ = CARRIERS[carrier]
    target, headers, body = build_request(fake.text)
    if carrier == "json-escaped":
        assert b"config:\\n\\u00" in body  # the carrier did escape the key
    result = SCANNER.scan_request("POST", target, headers, body)
    assert result.unreadable is None
    return list(result.findings)


@pytest.mark.parametrize("carrier", sorted(CARRIERS))
@pytest.mark.parametrize("fake", CORPUS, ids=lambda f: f.detector)
def test_every_fake_is_found_in_every_carrier(fake: Fake, carrier: str) -> None:
    findings = _case(fake, carrier)
    mine = [f for f in findings if f.detector == fake.detector]
    assert mine, f"{fake.detector} not found in {carrier}: {findings}"
    expected = CARRIERS[carrier][1]
    if expected is not None and fake.detector != "gcp-service-account":
        assert str(mine[0].location) == expected


@pytest.mark.parametrize("fake", CORPUS, ids=lambda f: f.detector)
def test_a_finding_never_holds_the_value(fake: Fake) -> None:
    for carrier in ("header", "json", "base64-in-json"):
        for finding in _case(fake, carrier):
            shown = f"{finding} {finding.describe()} {finding.location}"
            secret = fake.secret
            assert not any(secret[i:i + 10] in shown for i in range(0, len(secret) - 10, 3))


def test_the_fingerprint_is_the_same_secret_across_carriers_and_salted() -> None:
    fake = next(f for f in CORPUS if f.detector == "github")
    marks = {c: {f.fingerprint for f in _case(fake, c) if f.detector == "github"}
             for c in ("header", "json", "form", "gzip", "base64-body", "hex")}
    assert len(set().union(*marks.values())) == 1, marks
    other = Scanner(SCANNER.detectors, b"another-deployment")
    assert other.scan_text(fake.text, Location("header", "X"))[0].fingerprint \
        not in marks["header"]
    assert len(next(iter(marks["header"]))) == 16


def test_the_request_line_and_the_header_name_are_named() -> None:
    fake = next(f for f in CORPUS if f.detector == "stripe")
    result = SCANNER.scan_request("GET", f"/charge/{fake.text}/x", [("X-Api-Key", fake.text)])
    assert {str(f.location) for f in result.findings} == {"request line"}  # one secret
    result = SCANNER.scan_request("GET", "/", [("X-Api-Key", fake.text)])
    assert [str(f.location) for f in result.findings] == ["header X-Api-Key"]


def test_a_multipart_json_part_is_read_as_json() -> None:
    fake = next(f for f in CORPUS if f.detector == "anthropic")
    body = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"meta\"\r\n"
            f"Content-Type: application/json\r\n\r\n"
            + json.dumps({"env": {"KEY": fake.text}}) + f"\r\n--{BOUNDARY}--\r\n").encode()
    result = SCANNER.scan_body(body, MP)
    assert [str(f.location) for f in result.findings if f.detector == "anthropic"] == [
        "body multipart part meta $.env.KEY"]


def test_nested_encodings_stop_at_the_depth() -> None:
    fake = next(f for f in CORPUS if f.detector == "aws")
    once = base64.b64encode(fake.text.encode())
    twice = base64.b64encode(once)
    thrice = base64.b64encode(twice)
    assert SCANNER.scan_body(twice, "text/plain").findings
    assert not SCANNER.scan_body(thrice, "text/plain").findings  # depth 2 (documented)
    deeper = Scanner(SCANNER.detectors, b"s", depth=3)
    assert deeper.scan_body(thrice, "text/plain").findings


def test_a_percent_encoded_path_and_a_selection() -> None:
    key = next(f for f in CORPUS if f.detector == "github").text
    escaped = "%" + key[:1].encode().hex() + key[1:]
    result = SCANNER.scan_request("PUT", f"/files/{escaped}", [])
    assert [str(f.location) for f in result.findings] == ["request line (in percent)"]
    only = SCANNER.only(["aws", "slack"])
    assert only is SCANNER.only(["slack", "aws"])  # built once per selection
    assert [d.name for d in only.detectors] == ["aws", "slack"]
    assert only.scan_request("PUT", f"/files/{key}", []).clean


def test_a_body_over_the_limit_is_unreadable_not_skipped() -> None:
    small = Scanner(SCANNER.detectors, b"s", limit=100)
    assert small.scan_body(b"x" * 101, "text/plain").unreadable
    assert small.scan_body(gzip.compress(b"x" * 101), "text/plain", "gzip").unreadable
    assert small.scan_body(b"x" * 100, "text/plain").clean



def _form(delimiter: bytes, head: bytes, content: bytes) -> bytes:
    return (b"--" + delimiter + b"\r\nContent-Disposition: form-data; name=\"f\"" + head +
            b"\r\n\r\n" + content + b"\r\n--" + delimiter + b"--\r\n")


@pytest.mark.parametrize(("ctype", "body", "where"), [
    # a browser's boundary has capitals: the Content-Type was lowercased before its
    # boundary was read, no part was found, and nothing was read (a key in any part passed)
    ("multipart/form-data; boundary=----WebKitFormBoundaryAbC",
     _form(b"----WebKitFormBoundaryAbC", b"", b"{key}"), "multipart part f"),
    ("multipart/form-data; boundary=----WebKitFormBoundaryAbC",
     _form(b"----WebKitFormBoundaryAbC", b"\r\nContent-Encoding: gzip", b"{gz}"),
     "multipart part f"),
    ("multipart/form-data; boundary=b",  # (a part's coding: every line of it)
     _form(b"b", b"\r\nContent-Encoding: gzip\r\nContent-Encoding: identity", b"{gz}"),
     "multipart part f"),
    # outside the parts: a receiver storing the body as it came (an object store) keeps it
    ("multipart/form-data; boundary=b", b"{key}\r\n" + _form(b"b", b"", b"x"),
     "multipart preamble or epilogue"),
    ("multipart/form-data; boundary=b", _form(b"b", b"", b"x") + b"{key}",
     "multipart preamble or epilogue"),
    ("multipart/form-data; boundary=zzz", b"no delimiter, {key}",
     "multipart preamble or epilogue"),
])
def test_a_multipart_body_is_read_as_its_receivers_read_it(ctype: str, body: bytes,
                                                         where: str) -> None:
    key = next(f for f in CORPUS if f.detector == "github").text
    body = body.replace(b"{key}", key.encode()).replace(
        b"{gz}", gzip.compress(f"token {key}".encode()))
    found = ANCHORED.scan_body(body, ctype).findings
    assert [(f.detector, f.location.name) for f in found] == [("github", where)]


def _nested(levels: int, text: bytes) -> tuple[bytes, str]:
    body, ctype = text, "text/plain"
    for level in range(levels):
        mark = f"b{level}".encode()
        body = (b"--" + mark + b"\r\nContent-Type: " + ctype.encode() + b"\r\n\r\n" + body +
                b"\r\n--" + mark + b"--\r\n")
        ctype = f"multipart/mixed; boundary=b{level}"
    return body, ctype


def test_multipart_nested_past_its_depth_is_unreadable_not_a_crash() -> None:
    """Each level of parts is a few Python frames: 2,000 levels (a 139 KB body) raised
    RecursionError out of the scan (a 500); past `MULTIPART_DEPTH` it is unreadable."""
    key = next(f for f in CORPUS if f.detector == "github").text.encode()
    from gateway.core.dlp.multipart import MULTIPART_DEPTH

    body, ctype = _nested(MULTIPART_DEPTH, b"token " + key)
    assert [f.detector for f in ANCHORED.scan_body(body, ctype).findings] == ["github"]
    for levels in (MULTIPART_DEPTH + 1, 2000):
        body, ctype = _nested(levels, b"token " + key)
        assert "deeper than" in (ANCHORED.scan_body(body, ctype).unreadable or "")


def test_a_multipart_body_naming_two_boundaries_is_unreadable() -> None:
    body = _form(b"BBB", b"\r\nContent-Encoding: gzip", gzip.compress(b"x"))
    assert "more than one multipart boundary" in (ANCHORED.scan_body(
        body, "multipart/form-data; boundary=AAA; boundary=BBB").unreadable or "")


@pytest.mark.parametrize("ctype", [JSON, None, "text/plain"])
@pytest.mark.parametrize("sandbox", [None, "sb-1"])
@pytest.mark.parametrize("shape", ['{{"a": "{key}', '["x", {key}]', '{{"a": "{key}"}} trailing',
                                   '{{"a": "{key}", }}'])
def test_a_body_that_looks_like_json_and_is_not_a_document_is_read_as_text(
        ctype: str | None, sandbox: str | None, shape: str) -> None:
    """Neither the C reading nor `json` takes it: its text is read as it is (a JSON
    body's text is made only where needed; this is such a place)."""
    key = next(f for f in CORPUS if f.detector == "github").text
    body = shape.format(key=key).encode()
    found = SCANNER.scan_body(body, ctype, sandbox=sandbox).findings
    assert "github" in [f.detector for f in found], body

def test_a_key_repeated_in_an_object_is_read_twice() -> None:
    key = next(f for f in CORPUS if f.detector == "aws").text
    body = ('{"k": "' + key + '", "k": "harmless"}').encode()
    assert [f.detector for f in SCANNER.scan_body(body, JSON).findings] == ["aws"]
    assert json.loads(body) == {"k": "harmless"}  # (what a last-wins reader keeps)


def test_a_service_account_file_inside_a_json_string() -> None:
    sa = next(f for f in CORPUS if f.detector == "gcp-service-account").text
    only = SCANNER.only(["gcp-service-account"])
    body = json.dumps({"files": {"sa.json": sa}}).encode()
    assert [str(f.location) for f in only.scan_body(body, JSON).findings] == [
        'body $.files["sa.json"]']


@pytest.mark.parametrize("fake", [f for f in CORPUS if not f.opt_in and "\n" not in f.text],
                         ids=lambda f: f.detector)
def test_a_key_used_as_a_name_is_not_shown_in_the_location(fake: Fake) -> None:
    """A header name, query or form field name, JSON key or multipart part name holding
    a key: found, and the location does not show the name."""
    key = fake.text
    cases = [
        *([("/", [(key, "1")], b"", None)] if re.fullmatch(r"[\w.+/=-]+", key) else []),
        ("/?" + quote(key, safe="") + "=1", [], b"", None),
        ("/", [], json.dumps({"a": {key: 1}}).encode(), JSON),
        ("/", [], urlencode({key: "1"}).encode(), "application/x-www-form-urlencoded"),
        ("/", [], (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n'
                   f"x\r\n--{BOUNDARY}--\r\n").encode(), MP),
    ]
    for target, headers, body, ctype in cases:
        if ctype:
            headers = [*headers, ("Content-Type", ctype)]
        findings = SCANNER.scan_request("POST", target, headers, body).findings
        mine = [f for f in findings if f.detector == fake.detector]
        assert mine, (target, headers, body[:80])
        secret = fake.secret
        for finding in findings:
            shown = str(finding.location)
            assert not any(secret[i:i + 8] in shown for i in range(len(secret) - 7)), shown


# The default detectors: every rule anchored, so the cheap check on a body's bytes applies
# (an opt-in detector without an anchor makes every body go the whole way).
ANCHORED = Scanner(build(DEFAULT), b"test-salt")


def _escaped(text: str, form: str) -> str:
    """Every character of `text` escaped (%XX, or JSON's \\u00XX): no anchor and no run of
    base64 characters is left in the raw body, only in what a reader decodes."""
    return "".join((f"%{ord(c):02X}" if form == "percent" else f"\\u{ord(c):04x}")
                   for c in text)


@pytest.mark.parametrize(("ctype", "body"), [
    ("application/x-www-form-urlencoded", "note=hi&token=" + _escaped(GH := next(
        f.text for f in CORPUS if f.detector == "github"), "percent")),
    (JSON, '{"token": "' + _escaped(GH, "json") + '"}'),
])
def test_a_key_escaped_to_the_last_character_is_found(ctype: str, body: str) -> None:
    """The raw body holds no anchor and no base64 run: the cheap check on its bytes
    must not stop there while an escape could hide one."""
    assert "ghp_" not in body and not re.search(r"[A-Za-z0-9+/_-]{20}", body)
    result = ANCHORED.scan_body(body.encode(), ctype)
    assert [f.detector for f in result.findings] == ["github"]


def test_a_compressed_multipart_part_behind_a_short_boundary() -> None:
    """A part in its own Content-Encoding: the raw body shows nothing of the key."""
    part = gzip.compress(f"token {GH}\n".encode(), mtime=0)
    body = (b"--b\r\nContent-Disposition: form-data; name=\"f\"\r\nContent-Encoding: gzip"
            b"\r\n\r\n" + part + b"\r\n--b--\r\n")
    assert b"ghp_" not in body
    result = ANCHORED.scan_body(body, "multipart/form-data; boundary=b")
    assert [(f.detector, str(f.location)) for f in result.findings] == \
        [("github", "body multipart part f (in gzip)")]


# -- the one-pass gate the proxy asks first (head_clean, body_clean) -------------------------


@pytest.mark.parametrize("carrier", sorted(CARRIERS))
@pytest.mark.parametrize("fake", [f for f in CORPUS if not f.opt_in], ids=lambda f: f.detector)
def test_the_gate_never_calls_clean_what_a_detector_finds(fake: Fake, carrier: str) -> None:
    """`head_clean` and `body_clean` (one pass over the raw bytes, the body's codings
    undone as the exchange does) say False wherever the full scan finds the key: the
    default detectors only, where the gate is not bypassed by an unanchored rule."""
    target, headers, body = CARRIERS[carrier][0](fake.text)
    in_head = ANCHORED.scan_request("POST", target, headers).findings
    fields = [(k.encode(), v.encode("latin-1")) for k, v in headers]
    if any(f.detector == fake.detector for f in in_head):
        assert not ANCHORED.head_clean("POST", target, fields)
    named = {k.lower(): v for k, v in headers}
    plain = decode_content(body, named.get("content-encoding"), ANCHORED.limit)
    in_body = ANCHORED.scan_body(plain, named.get("content-type")).findings
    if any(f.detector == fake.detector for f in in_body):
        assert not ANCHORED.body_clean(plain, named.get("content-type"))
    assert any(f.detector == fake.detector for f in (*in_head, *in_body)), carrier


_AUTH = "https://deploy:Zq8vLm2pXw@git.example.com/r"  # no anchor but "://", no run


@pytest.mark.parametrize(("ctype", "body"), [
    # a JSON reader undoes \/ : "://" appears only then
    (JSON, json.dumps({"url": _AUTH}).replace("/", "\\/")),
    (None, json.dumps([_AUTH]).replace("/", "\\/")),  # JSON by its first character
    (JSON, " \n" + json.dumps({"url": _AUTH}).replace("s:", "s\\u003a")),
    # a form reader undoes %XX
    ("application/x-www-form-urlencoded", "a=1&url=" + quote(_AUTH, safe="")),
    # JSON in UTF-16 and UTF-32 (a JSON reader finds the codec by the first bytes)
    *((JSON, json.dumps({"url": GH}).encode(codec))
      for codec in ("utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le")),
])
def test_a_key_only_a_reader_sees_passes_the_gate(ctype: str | None,
                                                   body: str | bytes) -> None:
    """Attacks on the gate: the raw bytes hold no anchor the key needs and no base64 run,
    only what the body's reader decodes does."""
    raw = body.encode() if isinstance(body, str) else body
    assert b"://" not in raw and b"ghp_" not in raw
    assert not ANCHORED.body_clean(raw, ctype)
    found = ANCHORED.scan_body(raw, ctype).findings
    assert [f.detector for f in found] in (["basic-auth"], ["github"]), found


@pytest.mark.parametrize("target", [
    "/x?u=" + quote(_AUTH, safe=""),  # the query, as parsed
    "/x?u=https:\\/\\/deploy:Zq8vLm2pXw@git.example.com",  # the line unescaped
])
def test_a_key_only_the_query_reader_sees_passes_the_head_gate(target: str) -> None:
    assert not ANCHORED.head_clean("GET", target, [(b"Host", b"h")])
    assert [f.detector for f in ANCHORED.scan_request("GET", target, []).findings] == \
        ["basic-auth"]


def test_ordinary_heads_and_bodies_are_clean() -> None:
    """What the shortcut is for: one pass, and nothing to read further."""
    assert ANCHORED.head_clean("POST", "/v1/chat/completions", [
        (b"Host", b"api.example.com"), (b"Content-Type", b"application/json")])
    assert ANCHORED.body_clean(_chat("def f(x):\n    return x + 1"), JSON)
    assert ANCHORED.body_clean(b"", JSON)
    assert not ANCHORED.body_clean(_multipart("notes"), MP)  # (parts: by their own type)
    assert not SCANNER.body_clean(b"hello", "text/plain")  # (an unanchored detector)


def test_a_head_seen_clean_is_remembered_part_by_part_and_decides_as_a_fresh_one() -> None:
    """`head_clean` remembers the parts of heads it found clean, and passes only a head's
    new parts: over heads mixing parts seen before with every fake credential (in a
    value, in a name, beside a value it was seen with), it answers what it answers with
    nothing remembered, and never True where the full scan finds something."""
    ordinary = [(b"Host", b"api.example.com"), (b"User-Agent", b"OpenAI/Python 1.54.0"),
                (b"Content-Type", b"application/json"), (b"Accept", b"*/*")]
    assert ANCHORED.head_clean("POST", "/v1/chat/completions", ordinary)
    assert set(p for f in ordinary for p in f) <= ANCHORED.heads.seen
    for fake in (f for f in CORPUS if not f.opt_in and "\n" not in f.text):
        value = fake.text.encode("latin-1")
        for fields in ([*ordinary, (b"X-Key", value)],
                       [(b"Authorization", b"Bearer " + value), *ordinary],
                       [*ordinary[:2], (value[:40], b"1"), *ordinary[2:]],
                       [(b"Host", b"api.example.com " + value)]):
            remembered = ANCHORED.head_clean("POST", "/v1/chat/completions", fields)
            kept = set(ANCHORED.heads.seen)
            ANCHORED.heads.seen.clear()
            fresh = ANCHORED.head_clean("POST", "/v1/chat/completions", fields)
            ANCHORED.heads.seen.update(kept)
            assert remembered == fresh, (fake.detector, fields)
            found = ANCHORED.scan_request("POST", "/v1/chat/completions", [
                (k.decode("latin-1"), v.decode("latin-1")) for k, v in fields]).findings
            assert not (found and remembered), (fake.detector, fields, found)
            assert value not in ANCHORED.heads.seen


def test_what_head_clean_remembers_is_bounded() -> None:
    scanner = Scanner(build(("github",)), b"test-salt")
    for i in range(3 * scanner_parts()):
        assert scanner.head_clean("GET", f"/items/{i}", [(b"X-Request-Id", b"r%d" % i)])
        assert len(scanner.heads.seen) <= scanner_parts()
    long = b"x " * 200  # (over CLEAN_PART bytes: passed each time, never remembered)
    assert scanner.head_clean("GET", "/", [(b"X-Long", long)])
    assert long not in scanner.heads.seen


def scanner_parts() -> int:
    from gateway.core.dlp.heads import CLEAN_PARTS

    return CLEAN_PARTS


def _agent_texts(seed: int, count: int) -> list[str]:
    """Texts of tool call ids (mixed-case runs an agent resends every turn), with the
    fakes base64-, base64url- and hex-encoded among them, alone, glued to an id, cut
    short, behind an id's first characters, padded or not."""
    import random
    from string import ascii_letters, digits

    r = random.Random(seed)
    ids = ["call_" + "".join(r.choice(ascii_letters + digits) for _ in range(24))
           for _ in range(12)]
    encodings = [lambda b: base64.b64encode(b).decode(),
                 lambda b: base64.urlsafe_b64encode(b).decode().rstrip("="),
                 lambda b: b.hex(), lambda b: b.hex().upper()]
    out = []
    for _ in range(count):
        pieces = [r.choice(ids) for _ in range(r.randrange(1, 4))]
        if r.random() < 0.6:
            fake = r.choice(DEFAULT_CORPUS)
            encoded = r.choice(encodings)(fake.text.encode())
            pieces.append(r.choice([encoded, r.choice(ids) + encoded, encoded[:-2],
                                    r.choice(ids)[:9] + encoded, encoded + "==",
                                    r.choice(ids) + "=" + encoded]))
        r.shuffle(pieces)
        out.append(r.choice([" ", "\n", "/", ""]).join(pieces))
    return out


def test_runs_remembered_clean_decide_as_fresh_ones() -> None:
    """`decoded` remembers the stretches of the alphabet that decoded to nothing (an
    agent resends its tool call ids every turn): over texts mixing stretches seen
    before with every fake encoded among them (alone, glued to an id, cut, behind part
    of one), the scan with the memory finds what it finds without it, and no stretch
    remembered decodes to anything a detector reads."""
    scanner = Scanner(build(DEFAULT), b"test-salt")
    for text in _agent_texts(43, 400):
        body = json.dumps({"messages": [{"role": "tool", "content": text}]}).encode()
        for scan in (lambda b=body: scanner.scan_body(b, JSON).findings,
                     lambda t=text: scanner.scan_text(t, Location("body"))):
            remembered = scan()
            kept = set(scanner.runs.clean)
            scanner.runs.clean.clear()
            fresh = scan()
            scanner.runs.clean |= kept
            assert remembered == fresh, text
    assert scanner.runs.clean  # (the ids: remembered)
    # A stretch one character off one remembered (its first or its last) is read itself.
    for fake in DEFAULT_CORPUS:
        encoded = base64.b64encode(fake.text.encode()).decode().rstrip("=")
        for near in ("A" if encoded[0] != "A" else "B") + encoded[1:], \
                encoded[:-1] + ("A" if encoded[-1] != "A" else "B"):
            scanner.scan_text(f"id {near} end", Location("body"))
            assert scanner.scan_text(f"id {encoded} end", Location("body")), fake.detector
    kept = set(scanner.runs.clean)
    scanner.runs.clean.clear()
    for stretch in kept:
        assert next(scanner.decoded(stretch), None) is None, stretch
        scanner.runs.clean.clear()


def test_a_document_json_refuses_after_the_c_reading_took_it_keeps_its_findings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The C reading takes a document (up to 256 levels deep) that json could still
    refuse (its recursion limit, on a deep stack): the strings that held something are
    then read without their paths, and every finding is kept (fail closed)."""
    from gateway.core.dlp import jsondoc

    for fake in DEFAULT_CORPUS:
        body = _chat(fake.text)
        expected = {f.detector for f in SCANNER.scan_body(body, JSON).findings}
        assert expected
        monkeypatch.setattr(jsondoc, "load", lambda _body: jsondoc.NOT_JSON)
        if jsondoc.NATIVE:
            found = SCANNER.scan_body(body, JSON).findings
            assert {f.detector for f in found} >= expected, fake.detector
            assert all(f.location.part == "body" for f in found)
        monkeypatch.undo()


AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
GCP_KEY_ID = "0123456789abcdef0123456789abcdef01234567"
NAMED = Scanner(build(DEFAULT), b"test-salt")  # (no rule without anchors: see below)


@pytest.mark.parametrize(("body", "detector"), [
    (f'{{"aws_secret_access_key": "{AWS_SECRET}"}}', "aws"),
    (f'{{"\\u0061ws_secret_access_key": "{AWS_SECRET}"}}', "aws"),
    (f'{{"\\u0041WS_SECRET_ACCESS_KEY": "{AWS_SECRET}"}}', "aws"),
    (f'{{"aws_secret_access_\\u006bey": "{AWS_SECRET}"}}', "aws"),
    ('{{"aws_secret_access_key": "{}"}}'.format(AWS_SECRET.replace("/", "\\/")), "aws"),
    ('{{"aws_secret_access_key": "{}"}}'.format(AWS_SECRET.replace("/", "\\u002f")), "aws"),
    (f'{{"x": [{{"aws_key": "{AWS_SECRET}"}}]}}', "aws"),
    (f'{{"private_key_id": "{GCP_KEY_ID}"}}', "gcp-service-account"),
    (f'{{"private_key_i\\u0064": "{GCP_KEY_ID}"}}', "gcp-service-account"),
    (f'{{"\\u0070rivate_key_id" : "{GCP_KEY_ID}"}}', "gcp-service-account"),
])
def test_a_name_beside_its_value_is_read_with_its_escapes_undone(body: str,
                                                                 detector: str) -> None:
    """The rules that read a name beside its value read the JSON text as its reader
    does: a letter of the name (or the value's `/`) escaped does not hide the pair. The
    same value found in every spelling has the same fingerprint."""
    found = NAMED.scan_body(body.encode(), JSON).findings
    assert [f.detector for f in found] == [detector], body
    plain = NAMED.scan_body(json.dumps(json.loads(body)).encode(), JSON).findings
    assert found[0].fingerprint == plain[0].fingerprint


def test_the_name_rules_run_only_where_the_strings_hold_their_anchor() -> None:
    """The pass of the rules reading a name beside its value is made only where the
    strings (read first) hold one of their anchors (`Prefilter.string_anchors`): over
    random documents built of names, values and escapes, the findings with that skip
    equal the findings with the pass always made."""
    import random

    always = Scanner(build(DEFAULT), b"test-salt")
    assert always.string_anchors is not None
    always.string_anchors = None
    r = random.Random(43)
    names = ["aws_secret_access_key", "\\u0061ws_key", "AWS_TOKEN", "aw\\u0073_pass",
             "private_key_id", "private_key_i\\u0064", "laws", "note", "a", "\\u00e9aws"]
    values = [AWS_SECRET, AWS_SECRET.replace("/", "\\/"), GCP_KEY_ID, "plain words",
              "aws", "x\\nws", "\\u000aws", "\\u0c0aws_pass", "true", "\\\\u0061ws_key",
              "\\u0041\\u0057\\u0053_KEY", "\\ud83d\\ude00aws"]
    checked, found = 0, 0
    for _ in range(3000):
        pairs = [f'"{r.choice(names + values)}": "{r.choice(values + names)}"'
                 for _ in range(r.randrange(1, 4))]
        body = ("{" + ", ".join(pairs) + "}").encode()
        if json_codec_ok(body):
            checked += 1
            expected = always.scan_body(body, JSON).findings
            assert NAMED.scan_body(body, JSON).findings == expected, body
            found += any(f.detector in ("aws", "gcp-service-account") for f in expected)
    assert checked > 2500 and 300 < found < checked - 300, (checked, found)


def json_codec_ok(body: bytes) -> bool:
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


_SENT_AS = ["application/x-www-form-urlencoded", "application/x-www-form-urlencoded; charset=UTF-8",
            "multipart/form-data", "multipart/form-data; boundary=b", "text/plain"]


@pytest.mark.parametrize("ctype", _SENT_AS)
@pytest.mark.parametrize("shape", ["escaped letter", "escaped slashes"])
def test_a_json_document_is_read_as_json_whatever_its_type_says(ctype: str, shape: str) -> None:
    """A receiver that reads JSON whatever the type says (Go's `json.NewDecoder`, a
    framework's `request.json()`) undoes a JSON document's escapes: sent as a form, or as
    multipart with no part, it is read as JSON too (it was read as a form or as text,
    and `\\u0067hp_...` or `https:\\/\\/user:pass@...` passed); the clean check agrees."""
    key = "ghp_" + "Kq7RZx2mVt9LwNc4YbHs8PdJf3GaUe6TnQ1o"
    value = "\\u0067" + key[1:] if shape == "escaped letter" else \
        "https:\\/\\/deploy:Sup3rSecretPassw0rd@db.internal.test\\/x"
    body = json.dumps({"note": "deploy"}).encode()[:-1] + b', "v": "' + value.encode() + b'"}'
    assert json.loads(body)["v"] in (key, "https://deploy:Sup3rSecretPassw0rd@db.internal.test/x")
    assert not SCANNER.body_clean(body, ctype)
    found = {f.detector for f in SCANNER.scan_body(body, ctype).findings}
    assert found & {"github", "basic-auth"}, (ctype, shape, found)


def _arguments(value: str, levels: int) -> bytes:
    """A chat request whose tool call's `arguments` is JSON holding `value` as its JSON
    text spells it (escapes and all), nested `levels` times (JSON in a JSON string, in
    a JSON string...)."""
    text = '{"note": "' + value + '"}'
    assert json.loads(text)["note"] == json.loads(f'"{value}"')
    for _ in range(levels - 1):
        text = json.dumps({"args": text})
    return json.dumps({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "call_1", "function": {"name": "write", "arguments": text}}]}]}).encode()


@pytest.mark.parametrize("levels", [1, 2, 3])
@pytest.mark.parametrize("sandbox", [None, "sandbox-1"])
def test_json_inside_a_json_string_is_read_as_its_reader_reads_it(
        levels: int, sandbox: str | None) -> None:
    """A tool call's `arguments` is JSON in a JSON string: the receiver parsing it undoes
    its escapes, so `\\u0067hp_...` and `https:\\/\\/user:pass@...` there are read as
    `ghp_...` and `https://...`, however many levels in (up to `NESTED`), with or without
    the sandbox's history; so in a header's value and in a base64 run's text. (Read as
    text only before, they passed.)"""
    import base64 as b64

    key = "ghp_" + "Kq7RZx2mVt9LwNc4YbHs8PdJf3GaUe6TnQ1o"
    escaped = "\\u0067" + key[1:]
    url = "https:\\/\\/deploy:Sup3rSecretPassw0rd@db.internal.test\\/x"
    scanner = Scanner(build(DEFAULT), b"test-salt")
    for value, detector in ((escaped, "github"), (url, "basic-auth")):
        body = _arguments(value, levels)
        found = {f.detector for f in scanner.scan_body(body, "application/json",
                                                        sandbox=sandbox).findings}
        assert detector in found, (levels, value, found)
    carrier = '{"note": "' + escaped + '"}'
    head = scanner.scan_request("GET", "/", [("X-Meta", carrier)])
    assert "github" in {f.detector for f in head.findings}
    packed = json.dumps({"data": b64.b64encode(carrier.encode()).decode()}).encode()
    assert "github" in {f.detector for f in scanner.scan_body(packed, "application/json").findings}
