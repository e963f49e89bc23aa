"""Leak detection over every encoding a client could use, and echo redaction."""

from __future__ import annotations

import base64
import functools
import gzip
import json
import math
import random
from urllib.parse import quote

import pytest

from gateway.core.dlp import DEFAULT, Scanner
from gateway.core.dlp.fastscan import HYPERSCAN, RUN, ChunkPass, Gate
from gateway.core.leak_forms import (
    canonical,
    constant_token_markers,
    own_token_markers,
    sensitive_markers,
    token_markers,
)
from gateway.core.leaks import LeakScan, Redactor
from gateway.services.dlp.library import build
from gateway.services.identity.signing_keys import SigningKeys
from gateway.services.identity.tokens import TokenService
from gateway.services.state.base import MemoryState

KEY = "sk-live-0123456789abcdefghijklmnop"


@pytest.fixture(scope="module")
def token(tmp_path_factory: pytest.TempPathFactory) -> str:
    keys = SigningKeys.load(tmp_path_factory.mktemp("keys"))
    service = TokenService(keys, MemoryState(), lambda name: [])
    return service.mint("sandbox-1", "agent").token


def _swap_case(text: str) -> str:
    return text.swapcase()


# Every way finding 8 of the enforcement-core issue passed a token to an unbound host.
TOKEN_FORMS = {
    "raw": lambda t: t,
    "without its header": lambda t: t.split(".", 1)[1],
    "signature only": lambda t: t.rsplit(".", 1)[1],
    "hex": lambda t: t.encode().hex(),
    "HEX": lambda t: t.encode().hex().upper(),
    "base32": lambda t: base64.b32encode(t.encode()).decode(),
    "base64": lambda t: base64.b64encode(b"x:" + t.encode()).decode(),
    "swapped case": _swap_case,
    "%XX per character": lambda t: "".join(f"%{b:02X}" for b in t.encode()),
    "double %": lambda t: quote(quote(t, safe=""), safe=""),
    "json \\u escape": lambda t: json.dumps({"t": t}).replace("e", "\\u0065"),
    # UTF-16 and UTF-32 text, which a receiver may read so (its charset, a byte-order
    # mark, a guess): a NUL between the characters (they passed: no run, no marker)
    "UTF-16LE": lambda t: "".join(c + "\0" for c in t),
    "UTF-16BE": lambda t: "".join("\0" + c for c in t),
    "UTF-32LE": lambda t: "".join(c + "\0\0\0" for c in t),
}


@pytest.mark.parametrize("split", [False, True], ids=["one set", "as the gate builds it"])
@pytest.mark.parametrize("form", TOKEN_FORMS)
def test_token_found_in_every_form(token: str, form: str, split: bool) -> None:
    scan = (LeakScan(constant_token_markers("sandbox-gateway"), sensitive_markers(KEY.encode()),
                     own_token_markers(token)) if split
            else LeakScan(token_markers(token, "sandbox-gateway")))
    data = f"prefix {TOKEN_FORMS[form](token)} suffix".encode()
    assert scan.find(data) == "token"


def test_scans_of_many_tokens_share_one_automaton(token: str) -> None:
    """The markers every sandbox shares are compiled once: a gateway with thousands of
    sandboxes holds no automaton (~100 KB) per token; each token's own markers are a
    tuple of bytes."""
    shared = constant_token_markers("sandbox-gateway")
    keys = sensitive_markers(KEY.encode())
    scans = [LeakScan(shared, keys, own_token_markers(token[:-4] + f"{i:04d}"))
             for i in range(50)]
    assert len({id(s._automaton) for s in scans}) == 1
    assert scans[7].find(f"x {token[:-4]}0007 y".encode()) == "token"
    assert scans[7].find(f"x {KEY} y".encode()) == "secret"


def test_token_split_over_two_headers(token: str) -> None:
    scan = LeakScan(token_markers(token, "sandbox-gateway"))
    half = len(token) // 2
    fields = [(b"X-A", token[:half].encode()), (b"X-B", token[half:].encode())]
    assert scan.head("GET", "/", fields) == "token"


def test_another_tokens_payload_is_found_by_the_constant_claims(token: str) -> None:
    """A token the gateway never saw this sandbox use still starts its claims with the
    issuer and audience: payload.signature of any gateway token is caught."""
    scan = LeakScan(constant_token_markers("sandbox-gateway"))
    assert scan.find(token.split(".", 1)[1].encode()) == "token"


@pytest.mark.parametrize("data", [b"", b"hello world", b'{"model": "gpt-4o"}',
                                  b"eyJhbGciOiJSUzI1NiJ9.not-ours"])
def test_clean_data_passes(token: str, data: bytes) -> None:
    scan = LeakScan(token_markers(token, "sandbox-gateway"), sensitive_markers(KEY.encode()))
    assert scan.find(data) is None


@pytest.mark.parametrize("encode", [
    lambda k: k, lambda k: base64.b64encode(k.encode()).decode(), lambda k: quote(k),
    lambda k: k.encode().hex(), lambda k: base64.b64encode(b"user:" + k.encode()).decode(),
])
def test_keys_found(encode: object) -> None:
    scan = LeakScan((), sensitive_markers(KEY.encode()))
    assert scan.find(f"x={encode(KEY)}".encode()) == "secret"  # type: ignore[operator]


def test_stream_scan_finds_a_marker_across_chunks(token: str) -> None:
    scan = LeakScan(token_markers(token, "sandbox-gateway"))
    stream = scan.stream()
    body = b"a" * 5000 + token.encode() + b"b" * 10
    pieces = [body[i:i + 97] for i in range(0, len(body), 97)]
    assert any(stream.feed(p) for p in pieces)


def test_canonical_form() -> None:
    assert canonical(b"%41%2541\\u0042\\/Z") == b"aab/z"


def test_gzip_is_not_canonicalised_here() -> None:
    """Compressed bodies are decoded by `encodings` before the scan (the exchange does)."""
    scan = LeakScan((), sensitive_markers(KEY.encode()))
    assert scan.find(gzip.compress(KEY.encode())) is None


def test_markers_are_few_enough_for_the_hot_path(token: str) -> None:
    assert len(token_markers(token, "sandbox-gateway")) < 80
    assert len(sensitive_markers(KEY.encode())) < 30


@pytest.mark.parametrize("size", [1, 3, 7, 64])
def test_redactor_streams_without_leaking_a_split_key(size: int) -> None:
    redactor = Redactor([KEY.encode()])
    body = (b"echo " + KEY.encode() + b" and ") * 3
    out = b"".join(redactor.feed(body[i:i + size]) for i in range(0, len(body), size))
    out += redactor.end()
    assert KEY.encode() not in out and out.count(b"[REDACTED]") == 3
    assert math.isclose(len(out), len(body) - 3 * (len(KEY) - 10))


@pytest.mark.parametrize("codec", ["utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be",
                                   "utf-16", "utf-32"])
def test_a_key_echoed_as_utf16_or_utf32_text_is_redacted_at_every_cut(codec: str) -> None:
    """An upstream may echo the key as UTF-16 or UTF-32 text (it passed, the variants
    being ASCII): redacted, [REDACTED] written in the same, however the answer is cut;
    in a short text and a long one (the matchers differ)."""
    for pad in (10, 3000):
        text = "x" * pad + KEY + " y"
        body = text.encode(codec)
        for cut in [1, 2, 3, 5, 17, 64, len(body)]:
            redactor = Redactor([KEY.encode()], [KEY])
            out = b"".join(redactor.feed(body[i:i + cut]) for i in range(0, len(body), cut))
            out += redactor.end()
            assert out.decode(codec) == "x" * pad + "[REDACTED] y", (codec, pad, cut)
            assert redactor.redactions == 1
    assert Redactor([KEY.encode()], [KEY]).redact("plain text".encode("utf-16")) == \
        "plain text".encode("utf-16")


@pytest.mark.parametrize("size", [0, 100, 2047, 2048, 70_000])
@pytest.mark.parametrize(("carried", "want"), [
    ("key", "secret"), ("token", "token"), ("both", "token"), ("none", None)])
def test_short_and_long_texts_find_the_same(token: str, size: int, carried: str,
                                            want: str | None) -> None:
    """A head or short body goes through the automaton, a body of 2 KiB or more through
    Hyperscan (`_Markers.SMALL`): the same answer on both sides of the cut, a token
    winning over a key, for a marker at the text's start, middle and end."""
    scan = LeakScan(token_markers(token, "sandbox-gateway"), sensitive_markers(KEY.encode()))
    redactor = Redactor(sensitive_markers(KEY.encode()))
    marker = {"key": KEY, "token": token, "both": KEY + " " + token, "none": ""}[carried]
    for at in (0, size // 2, size):
        text = (b"q" * at + marker.encode() + b"q" * (size - at))
        assert scan.find(text) == want, (size, at)
        assert redactor.found_in([text]) == (carried in ("key", "both")), (size, at)


# -- a body without a base64 run is not lowercased nor searched (LeakScan.find) ----------

PROSE = "the request model parse file rows return value quoted field " * 40  # 2.4 KB


@functools.cache
def _gates() -> list[Gate | None]:
    """No gate (the run check alone), and outbound credential detection's gate; then
    both on Hyperscan where the C pass is the default (which also says which escapes a
    body holds: the leak guard's `_plain` searches are made only without it)."""
    detection = Scanner(build(DEFAULT), b"s").prefilter.gate
    return [None, detection,
            *([Gate(native=False), Gate(detection.literals, native=False)]
              if detection.native and HYPERSCAN else [])]


@pytest.mark.parametrize("split", [False, True], ids=["one set", "as the gate builds it"])
@pytest.mark.parametrize("form", TOKEN_FORMS)
def test_token_found_in_every_form_in_a_long_body(token: str, form: str, split: bool) -> None:
    """Every form, inside a body long enough to be asked for a run first."""
    scan = (LeakScan(constant_token_markers("sandbox-gateway"), sensitive_markers(KEY.encode()),
                     own_token_markers(token)) if split
            else LeakScan(token_markers(token, "sandbox-gateway")))
    data = f"{PROSE} {TOKEN_FORMS[form](token)} {PROSE}".encode()
    for gate in _gates():
        assert scan.find(data, gate) == "token"
        assert scan.stream().feed(data, gate) == "token"


def test_the_run_gate_loses_nothing_against_the_canonical_search(token: str) -> None:
    """Differential: `find` with the run gate (and with detection's gate, whose answer is
    then taken for the same body) says what the canonical-form search alone says, on
    long bodies of prose holding a token, its parts and encodings, a key (one with a
    dot: not a run, so such a scan never skips) whole, cut short, case-swapped, broken by
    a character, %-escaped or JSON-escaped."""
    rng = random.Random(43)
    dotted = "sk.live.0123456789"
    scans = [LeakScan(token_markers(token, "sandbox-gateway"), sensitive_markers(KEY.encode()),
                      own_token_markers(token)),
             LeakScan(constant_token_markers("sandbox-gateway"),
                      sensitive_markers(dotted.encode()), own_token_markers(token))]
    assert scans[0].marker_runs and not scans[1].marker_runs
    values = [token, KEY, dotted, *(f(token) for f in TOKEN_FORMS.values())]
    for _ in range(300):
        value = rng.choice(values)
        cut = rng.randrange(len(value) + 1)
        value = rng.choice([value, value[:cut], value.swapcase(), value[:cut] + rng.choice(
            " .é%\\") + value[cut + 1:], quote(value), json.dumps(value)[1:-1]])
        data = f"{PROSE[:rng.randrange(300, 2400)]} {value} {PROSE[:200]}".encode()
        for scan in scans:
            old = LeakScan(scan.tokens, scan.secrets, scan.own)
            old.marker_runs = False
            for gate in _gates():
                assert scan.find(data, gate) == old.find(data), (value, gate)


# -- a stream taking the answer of a pass shared with detection (StreamScan.feed's run) --

def _shared(scan: LeakScan, chunks: list[bytes]) -> list[str | None]:
    """What the stream says per chunk, taking detection's gate pass's answer: its run,
    and (as the request path does) the escapes the C pass saw; the same without them."""
    said = []
    for escapes in (True, False):
        passes = ChunkPass(_gates()[1] or Gate())
        stream = scan.stream()
        flags = [passes.flags(c, escapes=escapes) for c in chunks]
        said.append([stream.feed(c, run=bool(f & RUN), flags=f)
                     for c, f in zip(chunks, flags, strict=True)])
    assert said[0] == said[1]
    return said[0]


def _alone(scan: LeakScan, chunks: list[bytes]) -> list[str | None]:
    stream = scan.stream()
    return [stream.feed(c) for c in chunks]


def _first(said: list[str | None]) -> tuple[int, str | None]:
    """The chunk the stream is refused at, and why (the stream ends there)."""
    return next(((i, s) for i, s in enumerate(said) if s is not None), (len(said), None))


@pytest.mark.parametrize("form", TOKEN_FORMS)
def test_a_stream_taking_the_shared_answer_finds_every_form_at_every_cut(
        token: str, form: str) -> None:
    scan = LeakScan(token_markers(token, "sandbox-gateway"), sensitive_markers(KEY.encode()))
    value = TOKEN_FORMS[form](token).encode()
    data = PROSE.encode() + b" " + value + b" " + PROSE.encode()
    start = len(PROSE) + 1
    ends = 70  # (every cut near the value's ends, every 5th between: %XX is 1 KB long)
    for cut in range(start - 1, start + len(value) + 2):
        if ends < cut - start < len(value) - ends and cut % 5:
            continue
        for chunks in ([data[:cut], data[cut:]],
                       [data[:cut], data[cut:cut + 3], data[cut + 3:]]):
            said = _first(_shared(scan, chunks))
            assert said == _first(_alone(scan, chunks)) and said[1] == "token", (form, cut)


def test_a_window_after_an_escaped_one_is_searched() -> None:
    """A window whose canonical form undid an escape reaching into the tail it left (a
    `%` before the hex of a key: `%73` read as `s`) did not find the key; the next window
    holds the key without the `%`, as the old search found: taken the shared answer (no
    run in the new chunk), the stream searches it all the same."""
    scan = LeakScan((), sensitive_markers(KEY.encode()))
    hexed = KEY.encode().hex().encode()
    assert hexed in scan.secrets
    first = PROSE.encode() + b" %" + hexed + b" " * (scan.keep - len(hexed))
    chunks = [first, b" " + PROSE.encode()]
    assert _alone(scan, chunks) == [None, "secret"]
    assert _shared(scan, chunks) == [None, "secret"]


@pytest.mark.parametrize("at", [1, 2, 3, 4, 5])
def test_an_escape_across_the_seam_is_searched(at: int) -> None:
    """A key with one character JSON-escaped (`\\u0061`) where neither side of it is a
    run (19 characters before, 5 + 13 after), the chunks cut inside the escape: neither
    chunk holds a whole escape nor a run, the window of both holds the escape; it is
    searched and the key found, as before."""
    scan = LeakScan((), sensitive_markers(KEY.encode()))
    escaped = (KEY[:19] + f"\\u{ord(KEY[19]):04x}" + KEY[20:]).encode()
    cut = len(PROSE) + 1 + 19 + at
    data = PROSE.encode() + b" " + escaped + b" " + PROSE.encode()
    chunks = [data[:cut], data[cut:]]
    assert _alone(scan, chunks) == [None, "secret"]
    assert _shared(scan, chunks) == [None, "secret"]


def test_nuls_are_taken_out_in_one_table_pass() -> None:
    """Data holding a NUL is read again without its NULs (UTF-16 text): a table pass
    (`translate`), where `replace` took 17 ns a byte of NULs: a 40 KB request whose
    gzip run unpacks to 30 MiB of NULs cost the leak guard 0.8 s of a worker's CPU
    (1.1 s with detection) before the twenty-first session, ~0.1 s now."""
    import gzip
    import time

    leaks = LeakScan((), sensitive_markers(KEY.encode()))
    run = base64.b64encode(gzip.compress(b"\0" * (30 << 20), mtime=0))
    body = b'{"content": "' + run + b'"}'
    started = time.process_time()
    assert leaks.find(body) is None
    assert time.process_time() - started < 0.6
    assert leaks.find(("x\0" * 100 + KEY).encode("utf-16-le")) == "secret"


def test_a_message_read_whole_is_read_with_its_files(token: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`LeakScan.whole` (a WebSocket message): its bytes, then the files it is or holds,
    a gzip file or a zip's entries anywhere (the leak guard read a message's bytes only
    until the twenty-fourth session: a gzip message carried a token past it); a bomb is
    unreadable; a message without a file costs one search."""
    import io
    import zipfile

    from gateway.core import archives

    scan = LeakScan(token_markers(token, "sandbox-gateway"), sensitive_markers(KEY.encode()))
    raw = io.BytesIO()
    with zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(".env", f"T={token}\nK={KEY}\n")
    image_zip = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4 + raw.getvalue()
    for message in (gzip.compress(f"T={token}\n".encode(), mtime=0), image_zip):
        assert scan.find(message) is None and scan.whole(message) == "token"
    assert scan.whole(gzip.compress(f"K={KEY}\n".encode(), mtime=0)) == "secret"
    assert scan.whole(b'{"type": "input_text", "text": "hello"}') is None
    monkeypatch.setattr(archives, "FLOOR", 10_000)
    assert scan.whole(gzip.compress(b"\0" * 5_000_000, mtime=0)) == "unreadable"
