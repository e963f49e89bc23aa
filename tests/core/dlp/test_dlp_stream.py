"""The streaming scanner: a key split across chunks (at every offset), across WebSocket
fragments, inside a long base64 run crossing windows, in a gzip stream - found once,
whole, at its offset in the stream."""

from __future__ import annotations

import base64
import gzip
import json
import random
from collections.abc import Callable

import pytest
from helpers.dlp_corpus import DEFAULT_CORPUS, Fake, fake

from gateway.core.dlp import DEFAULT, Finding, Scanner, StreamScanner
from gateway.core.dlp.fastscan import BACKSLASH, ESCAPES_KNOWN, FOUND, PERCENT
from gateway.core.dlp.stream import STEP
from gateway.services.dlp.library import build

SCANNER = Scanner(build(DEFAULT), b"test-salt")


def _stream(data: bytes, cuts: list[int], coding: str | None = None) -> tuple[list[str], int]:
    """Detectors found and the offset of the first finding, feeding data cut at `cuts`."""
    stream = StreamScanner(SCANNER, coding)
    found = []
    for lo, hi in zip([0, *cuts], [*cuts, len(data)], strict=True):
        found += stream.feed(data[lo:hi]).findings
    found += stream.end().findings
    assert stream.unreadable is None
    return [f.detector for f in found], (found[0].location.offset or -1) if found else -1


# A stream fed alone, with the gate's shared pass, or with it through `passes` first (as
# outbound credential detection feeds a streamed body: `DlpCheck.feed`).
SHARED, SHARED_IDS, PASSES = (0, 1, 2), ("alone", "shared-pass", "passes-first"), 2


def _fed(stream: StreamScanner, chunk: bytes, flags: int | None,
         passes: bool = False) -> list[Finding]:
    """The findings of one piece: `passes` tried first where asked (it found nothing
    then), else `feed`."""
    if passes and flags is not None and stream.passes(chunk, flags):
        return []
    return list(stream.feed(chunk, flags).findings)


def _filler(n: int, seed: int) -> bytes:
    r = random.Random(seed)
    words = [b"the", b"request", b"model", b"import", b"def", b"return", b"value", b"{", b"}"]
    return b" ".join(r.choice(words) for _ in range(n // 5))[:n]


@pytest.mark.parametrize("fake", DEFAULT_CORPUS, ids=lambda f: f.detector)
def test_a_key_split_between_two_chunks_is_found_once(fake: Fake) -> None:
    key = fake.text.encode()
    head = _filler(50_000, 1) + b"\n"
    data = head + key + b"\n" + _filler(60_000, 2)
    for split in sorted({1, len(key) // 3, len(key) // 2, len(key) - 1}):
        names, offset = _stream(data, [len(head) + split])
        assert names.count(fake.detector) == 1, (split, names)
        assert offset >= len(head) - 1  # (a detector may start one character early)


def test_every_split_offset_of_one_key() -> None:
    key = fake("github").text.encode()
    data = _filler(20_000, 3) + b" " + key + b" " + _filler(20_000, 4)
    start = data.index(key)
    for split in range(start - 2, start + len(key) + 2):
        names, offset = _stream(data, [split])
        assert names == ["github"] and offset == start, split


def test_websocket_fragments_of_a_few_bytes() -> None:
    key = fake("anthropic").text.encode()
    data = b'{"type":"input_text","text":"' + _filler(3000, 5) + key + b'"}'
    cuts = list(range(7, len(data), 7))  # 7-byte fragments fed one by one
    names, _ = _stream(data, cuts)
    assert names == ["anthropic"]


def test_a_key_in_a_long_base64_run_across_windows() -> None:
    """A 300 KB base64 blob (an attachment) with the key at several depths of it: the run
    is cut at multiples of 4 of its start, so each window decodes at its alignment."""
    key = fake("aws").text.encode()
    for where in (10, 70_001, 150_002, 224_999):
        blob = bytearray(random.Random(where).randbytes(225_000))
        blob[where:where + len(key)] = key
        data = b'{"file":"' + base64.b64encode(bytes(blob)) + b'"}'
        names, _ = _stream(data, list(range(65_536, len(data), 65_536)))
        assert names == ["aws"], where


@pytest.mark.parametrize("encode", [
    lambda k: base64.b64encode(k), lambda k: base64.urlsafe_b64encode(b"\x00" + k),
    lambda k: k.hex().encode(), lambda k: k.hex().upper().encode()],
    ids=["base64", "base64url-shifted", "hex", "HEX"])
def test_an_encoded_key_across_the_window_cut_at_every_offset(encode: object) -> None:
    """The window's cut is moved back to a run's phase only where a run may cross it (a
    cheap check around the cut): a base64 or hex key crossing the cut at any character
    is still decoded whole, once."""
    assert callable(encode)
    run = encode(fake("github").text.encode())
    stream = StreamScanner(SCANNER)
    head = _filler(stream.keep + 100, 9) + b" "
    data = head + run + b" " + _filler(stream.keep, 10)
    for at in range(-3, len(run) + 3):
        first = len(head) + at + stream.keep  # fed at once: the cut falls at head + at
        names, _ = _stream(data, [first])
        assert names == ["github"], at


@pytest.mark.parametrize("variant", ["XOXB", "xOxB", "XoXb"])
def test_a_case_variant_split_across_chunks(variant: str) -> None:
    key = (variant + fake("slack").text[4:]).encode()
    data = _filler(40_000, 11) + b" " + key + b" " + _filler(40_000, 12)
    start = data.index(key)
    for split in (start + 1, start + 2, start + 3, start + len(key) // 2):
        names, _ = _stream(data, [split])
        assert names == ["slack"], (variant, split)


@pytest.mark.parametrize("coding", ["deflate", "br"])
def test_a_compressed_stream_with_a_base64_key(coding: str) -> None:
    import zlib

    import brotli
    key = base64.b64encode(fake("anthropic").text.encode())
    plain = _filler(150_000, 13) + b" " + key + b" " + _filler(150_000, 14)
    data = zlib.compress(plain) if coding == "deflate" else brotli.compress(plain)
    names, _ = _stream(data, list(range(777, len(data), 777)), coding)
    assert names == ["anthropic"]


def test_a_gzip_stream_is_decoded_as_it_comes() -> None:
    key = fake("slack").text.encode()
    data = gzip.compress(_filler(200_000, 6) + key + _filler(200_000, 7))
    names, _ = _stream(data, list(range(1000, len(data), 1000)), "gzip")
    assert names == ["slack"]


def test_a_zstd_stream_is_decoded_as_it_comes() -> None:
    """(Unreadable before the twenty-first session: no bounded zstd decoder.)"""
    from backports import zstd

    key = fake("slack").text.encode()
    data = zstd.compress(_filler(200_000, 6) + key + _filler(200_000, 7))
    names, _ = _stream(data, list(range(1000, len(data), 1000)), "zstd")
    assert names == ["slack"]


def test_what_a_stream_cannot_read() -> None:
    assert StreamScanner(SCANNER, "zstd").feed(b"not zstd").unreadable is not None
    assert StreamScanner(SCANNER, "compress").feed(b"x").unreadable is not None
    bad = StreamScanner(SCANNER, "gzip")
    assert bad.feed(b"not gzip at all").unreadable is not None
    after = StreamScanner(SCANNER, "gzip")
    after.feed(b"\x00garbage")
    assert after.feed(gzip.compress(b"x")).unreadable is not None  # stays unreadable


def test_a_clean_stream_reports_nothing() -> None:
    names, _ = _stream(_filler(500_000, 8), list(range(4096, 500_000, 4096)))
    assert names == []


@pytest.mark.parametrize("size", [1000, 4096, 16_384, 65_536, 70_000, 300_000, 1 << 20])
def test_what_a_stream_holds_back_is_bounded(size: int) -> None:
    """`pending` (what the engine holds back, not decided yet) stays under the window's
    keep + STEP (about 80 KiB: docs/dlp.md) whatever the chunk size; a chunk that fills
    the window is scanned at once, leaving only the kept tail (and up to three more
    characters where a base64 run's phase moves the cut)."""
    stream = StreamScanner(SCANNER)
    assert stream.keep + STEP <= 81 * 1024
    data = _filler(3 << 20, 13)
    for at in range(0, len(data), size):
        assert not stream.feed(data[at:at + size]).findings
        assert stream.pending < stream.keep + STEP
        if size >= stream.keep + STEP:
            assert stream.pending <= stream.keep + 3
    assert not stream.end().findings and stream.pending == 0


@pytest.mark.parametrize("detector", ["github", "aws", "slack", "jwt", "anthropic", "stripe"])
def test_a_key_across_a_chunk_and_the_window_cut_at_every_offset(detector: str) -> None:
    """A key split between two chunks at several offsets while the window is scanned
    with its cut at every offset of the key (a chunk fills the window exactly there):
    found once, whole, at its offset."""
    key = fake(detector).text.encode()
    stream = StreamScanner(SCANNER)
    for at in range(len(key) + 1):  # the cut falls `at` characters into the key
        start = STEP - at
        data = _filler(start - 1, 14) + b" " + key + b" " + _filler(stream.keep + 2000, 15)
        assert data.index(key) == start
        for split in sorted({1, len(key) // 2, len(key) - 1}):
            cuts = [start + split, STEP + stream.keep]  # the 2nd fills the window: a scan
            names, offset = _stream(data, cuts)
            assert names == [detector] and offset == start, (at, split, names)


@pytest.mark.parametrize(("ctype", "codec"), [
    ("text/plain; charset=utf-16", "utf-16"), ("text/plain; charset=utf-32-le", "utf-32-le"),
    ("text/plain; charset=cp500", "cp500"), ("text/plain", "utf-16"),  # (its BOM)
    ("application/json", "utf-16-le"),  # (no BOM: a JSON reader sniffs its NULs)
])
def test_a_streamed_body_in_another_charset_is_read_as_its_receiver_reads_it(
        ctype: str, codec: str) -> None:
    """The key's bytes never appear as they are; cut at every few bytes of its text, it
    is found once; and what is held back covers what the window has not decided."""
    key = fake("github").text
    body = ('{"k": "' + key + '", "pad": "' + "x" * 9000 + '"}').encode(codec)
    assert key.encode() not in body
    for cut in range(1, 60, 7):
        stream = StreamScanner(SCANNER, content_type=ctype)
        found = []
        for at in range(0, len(body), cut * 97):
            found += stream.feed(body[at:at + cut * 97]).findings
            undecided = len(stream._window)  # (UTF-8 bytes of the text not decided)
            assert stream.pending >= undecided * (len(body) / len(body.decode(codec)))
        found += stream.end().findings
        assert [f.detector for f in found] == ["github"], (cut, found)


def test_a_streamed_body_in_a_charset_without_a_codec_is_unreadable() -> None:
    stream = StreamScanner(SCANNER, content_type="text/plain; charset=x-klingon")
    assert stream.feed(b"abcd").unreadable is not None  # (four bytes: the sniff's)
    assert stream.end().unreadable is not None
    short = StreamScanner(SCANNER, content_type="text/plain; charset=x-klingon")
    assert short.feed(b"abc").unreadable is None and short.pending == 3  # (held back)
    assert short.end().unreadable is not None


@pytest.mark.parametrize(("codec", "ctype"), [
    ("utf-16-le", "application/json"),  # (no BOM: a JSON reader's NULs, four bytes)
    ("utf-32-be", "application/json"),
    ("utf-16", "text/plain"), ("utf-32", "text/plain"),  # (a BOM, no charset)
    ("utf-16", "text/plain; charset=utf-16"), ("utf-8", "text/plain"),
])
@pytest.mark.parametrize("first", [1, 2, 3])
def test_a_stream_whose_first_piece_is_shorter_than_a_sniff_is_read_in_its_charset(
        codec: str, ctype: str, first: int) -> None:
    """A chunked body's first chunk may be a byte (the sandbox picks its chunks): its
    reading is chosen once four bytes are in (before, one byte of a UTF-16 JSON body
    made the rest read as latin-1, and the key passed); what is held is pending."""
    key = fake("github").text
    body = ('{"k": "' + key + '", "pad": "' + "x" * 9000 + '"}').encode(codec)
    stream = StreamScanner(SCANNER, content_type=ctype)
    found = list(stream.feed(body[:first]).findings)
    assert stream.pending >= first
    for at in range(first, len(body), 997):
        found += stream.feed(body[at:at + 997]).findings
    found += stream.end().findings
    assert [f.detector for f in found] == ["github"]


def test_an_anchor_in_a_short_first_piece_is_read_with_the_pieces_flags() -> None:
    """An anchor wholly inside a first piece held back for the sniff is read: the next
    piece's flags (`ChunkPass`) read the seam, which holds it."""
    from gateway.core.dlp.fastscan import ChunkPass

    body = b"://deploy:Zq8vLm2pXw@git.example.com/r " + b"then some prose " * 700
    stream, shared = StreamScanner(SCANNER, content_type="text/plain"), \
        ChunkPass(SCANNER.prefilter.gate)
    found = []
    for piece in (body[:3], body[3:9], body[9:]):
        found += stream.feed(piece, shared.flags(piece, escapes=True)).findings
    found += stream.end().findings
    assert [f.detector for f in found] == ["basic-auth"]


def test_a_charset_decoder_that_fails_mid_stream_makes_it_unreadable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder's error is the stream's refusal (unreadable), not an exception out of
    the scan."""
    import codecs

    from gateway.core.dlp import stream as stream_module

    class Failing(codecs.IncrementalDecoder):
        def decode(self, data: bytes, final: bool = False) -> str:
            raise UnicodeError("UTF-16 stream does not start with BOM")

    monkeypatch.setattr(stream_module.codecs, "getincrementaldecoder", lambda _: Failing)
    stream = StreamScanner(SCANNER, content_type="text/plain; charset=utf-16")
    assert "cannot be read in its charset" in (stream.feed("x".encode("utf-16")).unreadable
                                               or "")


def _distinct_aws_keys(n: int) -> list[str]:
    rng = random.Random(7)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
    return [f"AKIA{''.join(rng.choice(alphabet) for _ in range(16))}" for _ in range(n)]


def test_a_stream_of_many_distinct_keys_holds_a_bounded_memory_of_them() -> None:
    """A hostile body (a sandbox's upload in report mode, an upstream's answer under
    `answers: report`) of thousands of distinct keys: each is reported, the stream
    remembers at most `SEEN` of them."""
    from gateway.core.dlp.stream import SEEN

    keys = _distinct_aws_keys(3 * SEEN)
    stream = StreamScanner(SCANNER, where="answer body")
    found = []
    for i in range(0, len(keys), 100):
        found += stream.feed(("\n".join(f"key{j} = {k}" for j, k in enumerate(
            keys[i:i + 100], i)) + "\n").encode()).findings
    found += stream.end().findings
    assert len({f.fingerprint for f in found if f.detector == "aws"}) == len(keys)
    assert len(stream._seen) <= SEEN


@pytest.mark.parametrize("shared", SHARED, ids=SHARED_IDS)
@pytest.mark.parametrize(("detector", "spell"), [
    ("github", lambda k: f"\\u{ord(k[0]):04x}{k[1:]}"),
    ("github", lambda k: k[:3] + "\\u005f" + k[4:]),
    ("basic-auth", lambda k: k.replace("/", "\\/")),  # (no run: only the escape is seen)
    ("slack", lambda k: "".join(f"\\u{ord(c):04x}" for c in k)),
])
def test_a_streamed_json_body_is_read_with_its_escapes_undone(
        detector: str, spell: Callable[[str], str], shared: int) -> None:
    """A JSON body streamed past the hold limit is read as its reader reads it, like a
    held one: a credential with `\\u` or `\\/` escapes is found, also where the gate's
    shared pass (`ChunkPass`) saw no run and no anchor in its chunk, only an escape (a
    body starting with `{` is JSON whatever its type says, as a held one is). The same
    escapes in a text are read so too (eighteenth session: a lenient JSON reader, one
    skipping a byte-order mark or a stray byte before the document, undoes them)."""
    from gateway.core.dlp.fastscan import ChunkPass

    key = spell(fake(detector).text).encode()
    note = b'deploy ' + key + b' now'
    document = (b'{"pad": "' + _filler(200_000, 7) + b'", "note": "' + note
                + b'", "more": "' + _filler(100_000, 8) + b'"}')
    text = b"notes: " + _filler(200_000, 7) + b"\n" + note + b"\n" + _filler(100_000, 8)
    for data, ctype, json_read in ((document, "application/json", True),
                                   (document, "text/plain", True),
                                   (text, "text/plain", True)):
        stream = StreamScanner(SCANNER, content_type=ctype)
        gate = ChunkPass(SCANNER.prefilter.gate)
        found = []
        for at in range(0, len(data), 16_384):
            chunk = data[at:at + 16_384]
            flags = gate.flags(chunk, escapes=True) if shared else None
            found += _fed(stream, chunk, flags, shared == PASSES)
        found += stream.end().findings
        names = [f.detector for f in found]
        assert names == [detector] if json_read else detector not in names, (ctype, names)


@pytest.mark.parametrize("shared", SHARED, ids=SHARED_IDS)
@pytest.mark.parametrize(("detector", "spell"), [
    ("github", lambda k: f"%{ord(k[0]):02X}{k[1:]}"),
    ("basic-auth", lambda k: k.replace(":", "%3A").replace("/", "%2F")),  # (no run)
    ("private-key", lambda k: k.replace(" ", "+").replace("\n", "%0A")),
])
def test_a_streamed_form_body_is_read_with_its_escapes_undone(
        detector: str, spell: Callable[[str], str], shared: int) -> None:
    """A form body streamed past the hold limit is read as its reader reads its fields,
    like a held one: `%XX` and `+` undone, also where the gate's shared pass saw only
    an escape in its chunk."""
    from gateway.core.dlp.fastscan import ChunkPass

    data = (b"pad=" + _filler(200_000, 9).replace(b" ", b"+") + b"&note="
            + spell(fake(detector).text).encode() + b"&more=" + _filler(100_000, 10)
            .replace(b" ", b"+"))
    stream = StreamScanner(SCANNER, content_type="application/x-www-form-urlencoded")
    gate = ChunkPass(SCANNER.prefilter.gate)
    found = []
    for at in range(0, len(data), 16_384):
        chunk = data[at:at + 16_384]
        found += _fed(stream, chunk, gate.flags(chunk, escapes=True) if shared else None,
                      shared == PASSES)
    found += stream.end().findings
    assert [f.detector for f in found] == [detector]


def test_a_streamed_body_of_one_anchor_over_and_over_is_unreadable_at_once() -> None:
    """4 MiB of a private key's header with no END, streamed: each window's matches
    would each read to the window's end; the scan says it cannot read it (the engine
    refuses, fail closed) within a bounded time, not minutes."""
    import time

    data = b"BEGIN PRIVATE KEY " * ((4 << 20) // 18)
    stream = StreamScanner(SCANNER, content_type="text/plain")
    started = time.perf_counter()
    results = [stream.feed(data[at:at + 65536]) for at in range(0, len(data), 65536)]
    results.append(stream.end())
    assert any(r.unreadable and "private-key candidates" in r.unreadable for r in results)
    assert time.perf_counter() - started < 2.0


@pytest.mark.parametrize("boundary", ["XyZ", "----WebKitFormBoundaryAbC"])
def test_a_streamed_multipart_body_is_read_as_text_or_refused(boundary: str) -> None:
    """Past the hold limit a multipart body is read as it came (no part decoded): a key
    in a part as sent is found, and a part whose coding a stream cannot undo is refused
    (before, a gzip part passed unread)."""
    key = fake("github").text
    delimiter = b"--" + boundary.encode()

    def body(head: bytes, content: bytes) -> bytes:
        return (delimiter + b"\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n" +
                b"x" * 70_000 + b"\r\n" + delimiter + b"\r\nContent-Disposition: form-data;"
                b" name=\"f\"" + head + b"\r\n\r\n" + content + b"\r\n" + delimiter + b"--\r\n")

    ctype = f"multipart/form-data; boundary={boundary}"
    for data, expected in ((body(b"", key.encode()), "found"),
                           (body(b"\r\nContent-Encoding: gzip",
                                 gzip.compress(key.encode())), "unreadable")):
        stream, found, unreadable = StreamScanner(SCANNER, content_type=ctype), [], None
        for at in range(0, len(data), 8192):
            result = stream.feed(data[at:at + 8192])
            found += result.findings
            unreadable = unreadable or result.unreadable
        end = stream.end()
        found += end.findings
        unreadable = unreadable or end.unreadable
        assert ("found" if [f.detector for f in found] == ["github"] else
                "unreadable" if unreadable and "content coding" in unreadable else None) \
            == expected


@pytest.mark.parametrize("piece", [7, 4096, 65536])
def test_a_streamed_json_document_sent_as_a_form_is_read_as_json_too(piece: int) -> None:
    """A JSON document streamed with a form's type: its windows are read both ways (a
    receiver reading JSON whatever the type says undoes `\\u0067`), and a form's
    escapes still count (`%67`)."""
    key = fake("github").text
    for value in ("\\u0067" + key[1:], "%67" + key[1:]):
        body = b'{"pad": "' + b"x " * 40_000 + b'", "note": "' + value.encode() + b'"}'
        stream = StreamScanner(SCANNER, content_type="application/x-www-form-urlencoded")
        found = []
        for at in range(0, len(body), piece):
            found += stream.feed(body[at:at + piece]).findings
        found += stream.end().findings
        assert [f.detector for f in found] == ["github"], (value, piece)


def test_a_streamed_body_reads_json_inside_its_strings() -> None:
    """A tool call's `arguments` (JSON in a JSON string) streamed past the hold limit:
    `\\u0067hp_...` in its text is `ghp_...` to the reader parsing it, found at any cut."""
    key = fake("github").text
    arguments = '{"note": "\\u0067' + key[1:] + '"}'
    body = b'{"pad": "' + b"x " * 40_000 + b'", "arguments": ' + \
        json.dumps(arguments).encode() + b'}'
    for piece in (7, 4096, 65536):
        stream = StreamScanner(SCANNER, content_type="application/json")
        found = []
        for at in range(0, len(body), piece):
            found += stream.feed(body[at:at + piece]).findings
        found += stream.end().findings
        assert [f.detector for f in found] == ["github"], piece


@pytest.mark.parametrize("fake", DEFAULT_CORPUS, ids=lambda f: f.detector)
def test_passes_takes_clean_pieces_and_every_credential_is_still_found(fake: Fake) -> None:
    """`passes` (the streamed body's way for a piece the shared pass found nothing in)
    takes most pieces of a large body and never one that matters: each detector's fake
    credential in a text, in a JSON string and escaped in one, cut at random offsets into
    pieces of random sizes, is found at its offset, as `feed` alone finds it."""
    from gateway.core.dlp.fastscan import ChunkPass

    rng = random.Random(fake.detector)
    secret = fake.text.encode()
    escaped = json.dumps(fake.text)[1:-1].encode()
    for ctype, body in (("text/plain", b"log: " + _filler(300_000, 1) + b"\n" + secret + b"\n"
                         + _filler(200_000, 2)),
                        ("application/json", b'{"a": "' + _filler(300_000, 3) + b'", "b": "'
                         + escaped + b'", "c": "' + _filler(200_000, 4) + b'"}')):
        answers, held = [], []
        seed = rng.random()
        for passes in (False, True):
            stream = StreamScanner(SCANNER, content_type=ctype, unpack=True)
            gate = ChunkPass(SCANNER.prefilter.gate)
            found: list[Finding] = []
            pending = []  # (what the engine holds back after each piece: the same)
            taken = at = 0
            cuts = random.Random(seed)
            while at < len(body):
                chunk = body[at:at + cuts.choice((1, 7, 300, 4096, 70_000, 140_000))]
                at += len(chunk)
                flags = gate.flags(chunk, escapes=True)
                if passes and stream.passes(chunk, flags):
                    taken += 1
                else:
                    found += stream.feed(chunk, flags).findings
                pending.append(stream.pending)
            found += stream.end().findings
            answers.append([(f.detector, f.location.offset) for f in found])
            held.append(pending)
            # (a service account's JSON holds a private key: found as both in a text, as
            # the key in a JSON string; each way finds the same)
            assert found and (fake.detector in [f.detector for f in found]
                              or fake.detector == "gcp-service-account"), (ctype, passes)
            assert not passes or taken, ctype  # (it did take clean pieces)
        assert answers[0] == answers[1], ctype
        assert held[0] == held[1], ctype


def test_passes_takes_every_piece_of_a_clean_body_after_the_first() -> None:
    """A clean 1 MiB text in 64 KiB pieces: the first is read by `feed` (its first bytes
    say how the body is read), `passes` takes the fifteen after it, and the window keeps
    only its tail (what `pending` holds back)."""
    from gateway.core.dlp.fastscan import ChunkPass

    stream = StreamScanner(SCANNER, content_type="text/plain", unpack=True)
    gate = ChunkPass(SCANNER.prefilter.gate)
    body = _filler(1 << 20, 5)
    pieces = [body[at:at + 65_536] for at in range(0, len(body), 65_536)]
    taken = [stream.passes(piece, gate.flags(piece, escapes=True)) or
             bool(stream.feed(piece, gate.flags(piece, escapes=True)).findings) for piece in pieces]
    assert taken == [False] + [True] * 15
    assert stream.pending <= stream.keep + STEP
    assert not stream.end().findings


@pytest.mark.parametrize(("why", "ctype", "coding", "first", "flags"), [
    ("an anchor or run found", "text/plain", None, b"hello world", FOUND | ESCAPES_KNOWN),
    ("a JSON escape", "application/json", None, b'{"a": "b"}', BACKSLASH | ESCAPES_KNOWN),
    ("a form escape", "application/x-www-form-urlencoded", None, b"a=b", PERCENT | ESCAPES_KNOWN),
    ("escapes not looked for", "text/plain", None, b"hello world", 0),
    ("the first bytes not read yet", "text/plain", None, b"", ESCAPES_KNOWN),
    ("a content coding", "text/plain", "gzip", None, ESCAPES_KNOWN),
    ("a charset", "text/plain; charset=utf-16", None, "hi".encode("utf-16"), ESCAPES_KNOWN),
    ("a multipart body's parts", "multipart/form-data; boundary=xyz", None,
     b"--xyz\r\ncontent-disposition: form-data; name=a\r\n\r\nhello", ESCAPES_KNOWN),
    ("an archive's files", "application/octet-stream", None, b"\x1f\x8b\x08\x00",
     ESCAPES_KNOWN),
])
def test_passes_declines_what_it_cannot_take(why: str, ctype: str, coding: str | None,
                                             first: bytes | None, flags: int) -> None:
    """`passes` does nothing and answers False for a piece `feed` must read: one the
    shared pass found something in, or of a stream read through a coding, a charset,
    parts or an archive's files, or before its first bytes were read."""
    stream = StreamScanner(SCANNER, coding, content_type=ctype, unpack=True)
    if first is None:
        first = gzip.compress(b"hello world " * 100)
    if first:
        assert stream.feed(first, flags & ~FOUND).unreadable is None
    before = stream.pending
    assert not stream.passes(b"more plain words " * 100, flags), why
    assert stream.pending == before  # (it did nothing)


def test_passes_declines_after_a_piece_with_a_finding_to_scan() -> None:
    """A piece the shared pass found something in makes the window due a scan: the
    pieces after it go through `feed` until it is scanned (a key cut by a piece's end)."""
    from gateway.core.dlp.fastscan import ChunkPass

    stream = StreamScanner(SCANNER, content_type="text/plain")
    gate = ChunkPass(SCANNER.prefilter.gate)
    key = fake("github").text.encode()
    head = b"notes " * 10 + key[:10]
    assert not stream.feed(head, gate.flags(head, escapes=True)).findings
    rest = key[10:] + b" and more words " * 10
    assert not stream.passes(rest, gate.flags(rest, escapes=True))
    found = stream.feed(rest, gate.flags(rest, escapes=True)).findings + stream.end().findings
    assert [f.detector for f in found] == ["github"]
