"""A streamed request body's way out (`RequestSide`): the leak guard and outbound
credential detection share one gate pass per chunk (issue 43, `fastscan.ChunkPass`).

Differential: the real `RequestSide` (real leak markers of a minted gateway token and an
injected key, the real detectors, Hyperscan where installed) against the two separate
scans it made before, the leak guard's window (`StreamScan.feed` without an answer) and
detection's (`StreamScanner.feed` without one), fed the same pieces: the same leak
refusal at the same chunk, the same findings at the same chunk, the same bytes held
back. Over random chunkings of large bodies with tokens, keys and fake credentials at
random offsets, in every encoding the streamed path reads, and over every cut through
each value."""

from __future__ import annotations

import base64
import functools
import gzip
import json
import random
import zlib
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import brotli
import pytest
from helpers.archives import spaced_gzip
from helpers.dlp_corpus import CORPUS, DEFAULT_CORPUS, Fake

from gateway.core.client import Client
from gateway.core.dlp import DEFAULT, DETECTORS, Dlp, Scanner, StreamScanner
from gateway.core.dlp.verdict import records
from gateway.core.encodings import decoder_for
from gateway.core.leak_forms import constant_token_markers, own_token_markers, sensitive_markers
from gateway.core.leaks import LeakScan
from gateway.core.messages import Headers, RequestHead
from gateway.core.refusal import Refusal
from gateway.core.target import Target
from gateway.core.trail import Trail
from gateway.pipeline.dlp_plans import Plan
from gateway.pipeline.exchange_dlp import DlpCheck
from gateway.pipeline.exchange_request import RequestSide
from gateway.pipeline.exchange_state import ExchangeState
from gateway.services.dlp.library import build
from gateway.services.identity.signing_keys import SigningKeys
from gateway.services.identity.tokens import TokenService
from gateway.services.state.base import MemoryState

SCANNER = Scanner(build(tuple(DETECTORS)), b"test-salt")
KEY = "sk-live-0123456789abcdefghijklmnop"  # an injected key, not bound to the host
HOST = "upload.example.test"
WORDS = ("the", "request", "model", "parse", "file", "rows", "return", "value", "quoted",
         "field", "def", "import", "json", "error", "stream", "count", "user", "{", "}")


@pytest.fixture(scope="module")
def token(tmp_path_factory: pytest.TempPathFactory) -> str:
    keys = SigningKeys.load(tmp_path_factory.mktemp("keys"))
    return TokenService(keys, MemoryState(), lambda name: []).mint("sandbox-1", "agent").token


@functools.cache
def _leaks(token: str) -> LeakScan:
    return LeakScan(constant_token_markers("sandbox-gateway"), sensitive_markers(KEY.encode()),
                    own_token_markers(token))


def _forms(value: str) -> dict[str, str]:
    """The encodings a leak is looked for in (`leak_forms.sensitive_markers`, `canonical`)."""
    return {"raw": value, "swapped case": value.swapcase(), "hex": value.encode().hex(),
            "base64": base64.b64encode(b"x:" + value.encode()).decode(),
            "base32": base64.b32encode(value.encode()).decode(),
            "%XX": "".join(f"%{b:02X}" for b in value.encode()),
            "double %": quote(quote(value, safe=""), safe=""),
            "json \\u": json.dumps({"t": value}).replace("e", "\\u0065")}


def _fakes(fakes: tuple[Fake, ...]) -> dict[str, str]:
    """Fake credentials as sent and in the runs a streamed body is decoded from."""
    out: dict[str, str] = {}
    for f in fakes:
        out[f.detector] = f.text
        out[f"{f.detector} base64"] = base64.b64encode(f.text.encode()).decode()
        out[f"{f.detector} hex"] = f.text.encode().hex()
    return out


def _values(token: str) -> dict[str, str]:
    values = {f"token {k}": v for k, v in _forms(token).items()}
    values |= {"token without header": token.split(".", 1)[1],
               "token signature": token.rsplit(".", 1)[1]}
    values |= {f"key {k}": v for k, v in _forms(KEY).items()}
    return values | _fakes(DEFAULT_CORPUS)


def _filler(rng: random.Random, n: int, kind: str) -> str:
    """`n` characters without a candidate for either check (prose, JSON with escapes,
    a form), or full of runs (base64: every chunk looked at)."""
    if kind == "base64":
        return base64.b64encode(rng.randbytes(n)).decode()[:n]
    words = [rng.choice(WORDS) for _ in range(n // 4 + 1)]
    if kind == "json":
        words = [w + rng.choice(["", "", "\\n", "\\\"", "\\u00e9", ","]) for w in words]
    elif kind == "form":
        words = [w + rng.choice(["", "=", "&", "%20", "+"]) for w in words]
    return " ".join(words)[:n]


@dataclass
class Outcome:
    """What a stream's checks said, chunk by chunk."""

    leak: tuple[int, str] | None = None  # (chunk, kind) of the leak refusal
    found: list[list[dict[str, Any]]] = field(default_factory=list)  # findings per chunk
    held: list[int] = field(default_factory=list)  # detection's bytes held back per chunk


def _exchange(token: str, ctype: str, coding: str | None, dlp: DlpCheck) -> ExchangeState:
    fields = [(b"content-type", ctype.encode())]
    if coding:
        fields.append((b"content-encoding", coding.encode()))
    return ExchangeState(
        Trail(lambda line: None, lambda: None),  # type: ignore[arg-type,return-value]
        None, Client(("127.0.0.1", 1)), None,  # type: ignore[arg-type]
        RequestHead("POST", "/upload", Headers(fields)), Target("https", HOST, 443, "/upload"),
        None, None, 0.0, scan=_leaks(token), dlp=dlp)  # type: ignore[arg-type]


def _shared(token: str, chunks: list[bytes], ctype: str, coding: str | None,
            dlp: Dlp) -> Outcome:
    """The real way out: `RequestSide.feed` per chunk, detection reporting only."""
    check = DlpCheck(Plan(SCANNER, dlp, report=True), HOST, "r")
    side = RequestSide(_exchange(token, ctype, coding, check))
    out = Outcome()
    for i, chunk in enumerate([*chunks, None]):
        before = len(check.found)
        try:
            if chunk is not None:
                side.feed(chunk)
            else:
                side.end(None)
        except Refusal as refusal:
            assert refusal.code == "exfiltration_blocked", refusal.reason
            out.leak = (i, "token" if "gateway token" in refusal.reason else "secret")
            return out
        out.found.append(check.found[before:])
        out.held.append(check.pending)
    return out


def _separate(token: str, chunks: list[bytes], ctype: str, coding: str | None,
              dlp: Dlp) -> Outcome:
    """The scans before the shared pass: each check its own, on the same pieces."""
    leak = _leaks(token).stream()
    stream = StreamScanner(SCANNER.only(dlp.detectors or DEFAULT), content_type=ctype)
    decoder = decoder_for(coding)
    out = Outcome()
    for i, chunk in enumerate([*chunks, None]):
        if decoder is None:
            pieces = [chunk] if chunk is not None else []
        else:
            pieces = list(decoder.feed(chunk) if chunk is not None else decoder.end())
        found = []
        for piece in pieces:
            kind = leak.feed(piece)
            if kind is not None:
                out.leak = (i, kind)
                return out
            found += stream.feed(piece).findings
        if chunk is None:
            found += stream.end().findings
        out.found.append(records(found, "report"))
        out.held.append(stream.pending)
    return out


def _compare(token: str, body: bytes, cuts: list[int], ctype: str = "text/plain",
             coding: str | None = None, dlp: Dlp | None = None) -> Outcome:
    dlp = dlp or Dlp(action="refuse", detectors=tuple(f.detector for f in DEFAULT_CORPUS))
    sent = {None: lambda b: b, "gzip": gzip.compress, "deflate": zlib.compress,
            "br": lambda b: brotli.compress(b, quality=1)}[coding](body)
    cuts = sorted({c for c in cuts if 0 < c < len(sent)})
    chunks = [sent[lo:hi] for lo, hi in zip([0, *cuts], [*cuts, len(sent)], strict=True)]
    new = _shared(token, chunks, ctype, coding, dlp)
    old = _separate(token, chunks, ctype, coding, dlp)
    assert new == old, (cuts[:20], ctype, coding)
    return new


def _cuts(rng: random.Random, size: int) -> list[int]:
    """A random chunking: pieces of a few bytes, of some KiB and of TLS reads, mixed."""
    cuts, at = [], 0
    while at < size:
        at += rng.choice([rng.randint(1, 40), rng.randint(100, 6000),
                          rng.randint(16_000, 70_000)])
        cuts.append(at)
    return cuts


def test_random_chunkings_of_bodies_with_values_at_random_offsets(token: str) -> None:
    rng = random.Random(43)
    values = _values(token)
    names = sorted(values)
    leaks = found = 0
    for _ in range(100):
        kind = rng.choice(["prose", "prose", "json", "form", "base64"])
        size = rng.choice([3_000, 90_000, 250_000])
        body = _filler(rng, size, kind)
        for name in rng.sample(names, rng.choice([0, 1, 1, 2, 3])):
            at = rng.randrange(len(body))
            body = body[:at] + " " + values[name] + " " + body[at:]
        ctype = rng.choice(["text/plain", "application/json", "text/plain; charset=utf-16"])
        data = body.encode("utf-16" if "utf-16" in ctype else "utf-8")
        coding = rng.choice([None, None, None, "gzip", "br", "deflate"])
        outcome = _compare(token, data, _cuts(rng, len(data)), ctype, coding)
        leaks += outcome.leak is not None
        found += any(outcome.found)
    assert leaks > 15 and found > 15  # (both checks had something to find, often)


def _every_cut(value: str) -> list[int]:
    """Offsets in `value` to cut at: each one, but of a long value (past the longest
    literal or run the pass looks for, twice) each one near its ends and every 7th."""
    ends = 70
    return [i for i in range(-2, len(value) + 3)
            if len(value) <= 2 * ends or i < ends or i > len(value) - ends or i % 7 == 0]


NAMES = sorted(_values("a.b.c"))  # (the names: the values need the minted token)


@pytest.mark.parametrize("name", NAMES)
def test_every_cut_through_each_value_finds_it_as_before(token: str, name: str) -> None:
    """Each value in a body of prose (the only candidate in it), cut at each offset, and
    with a piece of 1, 2 or 5 bytes from there (seams closer than the pass's overlap)."""
    rng = random.Random(name)
    value = _values(token)[name]
    head, tail = _filler(rng, 4500, "prose") + " ", " " + _filler(rng, 700, "prose")
    body = (head + value + tail).encode()
    for i in _every_cut(value):
        at = len(head) + i
        for cuts in ([at], [at, at + (1, 2, 5)[i % 3]]):
            outcome = _compare(token, body, cuts)
            if name.startswith(("token", "key")):
                assert outcome.leak is not None, cuts
            else:
                assert any(outcome.found), cuts


def test_a_value_kept_across_detection_windows(token: str) -> None:
    """A fake credential near where detection cuts its window (it is kept, unreported,
    into the next window): found in the window after, as before, by every chunking."""
    rng = random.Random(11)
    for f in DEFAULT_CORPUS:
        for back in (10, 2_000, 16_000, 17_000):
            at = 82_100 - back  # (a window is scanned at keep + STEP characters)
            body = (_filler(rng, at, "prose") + " " + f.text + " "
                    + _filler(rng, 90_000, "prose")).encode()
            outcome = _compare(token, body, _cuts(rng, len(body)))
            assert any(outcome.found), (f.detector, back)


def test_a_detector_without_anchors_scans_every_window(token: str) -> None:
    """Opt-in detectors without a literal anchor: detection does not take the pass's
    answer (a window without a run or an anchor may hold one of theirs)."""
    rng = random.Random(13)
    opt_in = tuple(f for f in CORPUS if f.opt_in)
    dlp = Dlp(action="refuse", detectors=tuple(f.detector for f in opt_in))
    short = Fake("keyword", 'db_password = "hunter2hunter"', True)  # (no run in it)
    for f in (*opt_in, short):
        body = (_filler(rng, 50_000, "prose") + " " + f.text + " "
                + _filler(rng, 40_000, "prose")).encode()
        outcome = _compare(token, body, _cuts(rng, len(body)), dlp=dlp)
        assert any(r["detector"] == f.detector for chunk in outcome.found for r in chunk), \
            f.detector


def test_what_goes_upstream_is_the_body_as_sent(token: str) -> None:
    """The bytes released chunk by chunk, then at the end, are the body, unchanged: the
    engines' chunks (bytes, or a bytearray from the TLS reader) mixed with small ones,
    which detection's window gathers in a buffer of its own, never in a chunk."""
    rng = random.Random(17)
    for _ in range(20):
        body = _filler(rng, 400_000, rng.choice(["prose", "base64"])).encode()
        cuts = sorted(set(_cuts(rng, len(body))))
        check = DlpCheck(Plan(SCANNER, Dlp(action="refuse"), report=True), HOST, "r")
        side = RequestSide(_exchange(token, "text/plain", None, check))
        out = []
        for lo, hi in zip([0, *cuts], cuts, strict=False):
            piece = body[lo:hi]
            out.append(side.feed(bytearray(piece) if rng.random() < 0.5 else piece))
        out.append(side.end(None))
        assert b"".join(out) == body


def test_the_leak_guard_reads_an_archives_files_however_the_body_is_cut(token: str) -> None:
    """A `.tar.gz` (or an upload form's zip part) holding the gateway token in a file:
    refused whichever piece its first bytes come in, two bytes alone included (the look
    at a body's first byte is at its first piece's); the same archive without the token
    goes through whole."""
    import io
    import tarfile
    import zipfile

    def tar_gz(data: bytes) -> bytes:
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w") as tar:
            info = tarfile.TarInfo(".env")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        return gzip.compress(raw.getvalue(), mtime=0)

    def form(data: bytes) -> bytes:
        raw = io.BytesIO()
        with zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr(".env", data)
        return (b"--b\r\nContent-Disposition: form-data; name=\"f\"\r\n\r\n" + raw.getvalue()
                + b"\r\n--b--\r\n")

    dlp = Dlp(action="refuse", detectors=("github",))
    secret = f"GATEWAY_TOKEN={token}\n".encode()
    for make, ctype in ((tar_gz, "application/gzip"),
                        (form, "multipart/form-data; boundary=b")):
        body = make(secret)
        assert token.encode() not in body
        for cuts in ([2], [1, 3, 5], [len(body) // 2], []):
            chunks = [body[lo:hi] for lo, hi in zip([0, *cuts], [*cuts, len(body)],
                                                    strict=True)]
            assert _shared(token, chunks, ctype, None, dlp).leak is not None, (ctype, cuts)
        clean = make(b"NOTES=1\n")
        assert _shared(token, [clean[:2], clean[2:]], ctype, None, dlp).leak is None


def test_a_multipart_part_head_past_its_bound_is_refused_not_raised(token: str) -> None:
    """The leak guard reads an upload form's parts for archives: a part head longer
    than a streamed part's bound is a bad request (`400`), not an error escaping it."""
    body = b"--b\r\nX-Pad: " + b"a" * 20_000 + b"\r\n\r\nx\r\n--b--\r\n"
    check = DlpCheck(Plan(SCANNER, Dlp(action="refuse"), report=True), HOST, "r")
    side = RequestSide(_exchange(token, "multipart/form-data; boundary=b", None, check))
    with pytest.raises(Refusal) as refused:  # (its head still coming past the bound)
        side.feed(body[:18_000])
    assert refused.value.code == "bad_request" and "head is longer" in refused.value.reason


@pytest.mark.parametrize("ctype", ["application/json", "text/plain"])
def test_a_compressed_runs_bytes_go_upstream_only_once_what_they_unpack_to_is_read(
        token: str, ctype: str) -> None:
    """A base64 run of a gzip file, streamed (no `dlp:` on the rule), 1.9 MB (past the
    1 MiB it was refused at before the twenty-first session): what of it goes upstream
    unpacks to none of the token at its file's end (the leak guard follows the run,
    `StreamScan.held_back`); a file without one goes through whole. As a text body the
    run ends with the body: read to its end there (`RequestSide.end`)."""
    words = b" ".join(b"entry %d ok" % i for i in range(30_000))
    noise = random.Random(3).randbytes(1_000_000)
    for tail, refused in ((b"\nT=" + token.encode(), True), (b"\n", False)):
        plain = words + noise + tail
        run = base64.b64encode(gzip.compress(plain, mtime=0))
        body = b'{"content": "' + run + b'", "n": 1}' if ctype != "text/plain" else run
        out, refusal = _sent(token, ctype, body, 8192)
        if refusal is None:
            assert not refused and b"".join(out) == body
            continue
        assert refused and refusal.code == "exfiltration_blocked", refusal.reason
        went = b"".join(out)[body.index(run):]
        shown = zlib.decompressobj(31).decompress(base64.b64decode(went[:len(went) // 4 * 4]))
        assert len(shown) <= len(plain) - len(tail) and len(went) > 1_000_000


def _sent(token: str, ctype: str, body: bytes, step: int) -> tuple[list[bytes], Refusal | None]:
    """What `RequestSide` let go upstream of `body` fed in pieces of `step` bytes (a
    leak guard with no `dlp:`), and its refusal, if any."""
    side = RequestSide(_exchange(token, ctype, None, None))  # type: ignore[arg-type]
    out: list[bytes] = []
    try:
        for i in range(0, len(body), step):
            out.append(side.feed(body[i:i + step]))
        out.append(side.end(None))
    except Refusal as refusal:
        return out, refusal
    return out, None


@pytest.mark.parametrize("dlp", [False, True], ids=["leak guard", "with dlp"])
def test_a_zip_after_other_bytes_is_read_however_the_body_is_cut(token: str, dlp: bool) -> None:
    """An image that is also a zip (unzip extracts it), the gateway token in its .env:
    refused wherever the pieces cut it, its first pieces holding no file (no reader of
    its files made for them: `zip_entries.quiet`) and its zip's signature cut between
    two pieces included; without the token it goes through whole."""
    import io
    import zipfile

    def image_zip(data: bytes) -> bytes:
        raw = io.BytesIO()
        with zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr(".env", data)
        return b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 40 + raw.getvalue()

    check = Dlp(action="refuse", detectors=("github",))
    body = image_zip(f"GATEWAY_TOKEN={token}\n".encode())
    at = body.find(b"PK\x03\x04")
    assert token.encode() not in body and at > 10_000
    for cuts in ([3], [4000, 8000], *([at + k] for k in range(-3, 5)), [at + 30, at + 40],
                 [7, at + 2, at + 200]):
        chunks = [body[lo:hi] for lo, hi in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        if dlp:
            assert _shared(token, chunks, "image/png", None, check).leak is not None, cuts
        else:
            side = RequestSide(_exchange(token, "image/png", None, None))  # type: ignore[arg-type]
            with pytest.raises(Refusal) as refused:
                for chunk in chunks:
                    side.feed(chunk)
                side.end(None)
            assert refused.value.code == "exfiltration_blocked", cuts
    clean = image_zip(b"NOTES=1\n")
    assert _shared(token, [clean[:at], clean[at:]], "image/png", None, check).leak is None


def test_an_archives_files_runs_share_the_bodys_bound(
        token: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The leak guard's reading of a streamed archive's files unpacks their compressed
    runs within the body's allowance, not one grown by what the files unpack to."""
    from gateway.core import archives

    monkeypatch.setattr(archives, "FLOOR", 500_000)
    monkeypatch.setattr(archives, "RATIO", 1)
    r = random.Random(9)
    words = " ".join(r.choice(["alpha", "beta", "gamma"]) + str(r.randrange(10**6))
                     for _ in range(50_000)).encode()[:600_000]
    sparse = base64.b64encode(gzip.compress(b"\0" * 200_000, mtime=0))
    body = gzip.compress(words + b"\n" + b"\n".join([sparse] * 4) + b"\n", mtime=0)
    side = RequestSide(_exchange(token, "application/gzip", None, None))  # type: ignore[arg-type]
    with pytest.raises(Refusal) as refused:
        for i in range(0, len(body), 16_384):
            side.feed(body[i:i + 16_384])
        side.end(None)
    assert refused.value.code == "bad_request"


@pytest.mark.parametrize("ctype", ["application/gzip", "multipart/form-data; boundary=b"])
def test_an_archive_bodys_bytes_go_upstream_only_once_what_they_unpack_to_is_read(
        token: str, ctype: str) -> None:
    """A streamed `.gz` (or an upload form's gzip part) whose deflate stream spaces a
    key's halves apart by thousands of empty blocks (giving nothing): what goes upstream
    unpacks to none of the key (its first half's compressed bytes are held until the
    key is read whole); a clean one goes whole, and the plain part after it is not held."""
    words = b" ".join(b"entry %d ok" % i for i in range(30_000)) + b"\nK="
    for secret, refused in ((KEY.encode(), True), (b"not-a-key-at-all-x", False)):
        packed = spaced_gzip(words, secret, b"\n", 6_000)
        head = b'--b\r\nContent-Type: application/gzip\r\n\r\n' if "multipart" in ctype else b""
        tail = b"\r\n--b\r\nContent-Type: text/plain\r\n\r\n" + b"plain " * 500_000 + \
            b"\r\n--b--\r\n" if head else b""
        body = head + packed + tail
        out, refusal = _sent(token, ctype, body, 4096)
        if refusal is not None:
            assert refused and refusal.code == "exfiltration_blocked", refusal.reason
            went = b"".join(out)[len(head):]
            shown = zlib.decompressobj(31).decompress(went)
            assert len(shown) <= len(words) and len(went) > 50_000
            continue
        assert not refused and b"".join(out) == body
        if tail:  # (the plain part after it: sent as it came, not held to the end)
            assert len(b"".join(out[:-1])) > len(body) - 100_000
