"""What of a head detection reads (`core/dlp/heads.py`): the parts found clean are
remembered, a head is read for its new parts only, and the scan reads only the fields
that hold a part that is not clean. Held to the full scan of the whole head: every fake
credential, in every place of a head, beside the values an SDK makes new on every
request (a trace id, an idempotency key), with the memory warm and cold."""

from __future__ import annotations

import base64
import random
import uuid

import pytest
from helpers.dlp_corpus import CORPUS, Fake

from gateway.core.dlp import DEFAULT, Location, Scanner
from gateway.core.dlp.heads import CLEAN_PART, CLEAN_PARTS, CleanParts
from gateway.services.dlp.library import build

SCANNER = Scanner(build(DEFAULT), b"test-salt")
_R = random.Random(4343)
Fields = list[tuple[bytes, bytes]]


def _traceparent() -> bytes:
    return b"00-%s-%s-01" % (_R.randbytes(16).hex().encode(), _R.randbytes(8).hex().encode())


def _sdk_head(length: int = 1234) -> Fields:
    """An OpenAI Python SDK's head (its fixed fields, and three values new each time)."""
    return [(b"host", b"api.openai.com"), (b"accept-encoding", b"gzip, deflate"),
            (b"connection", b"keep-alive"), (b"accept", b"application/json"),
            (b"content-type", b"application/json"), (b"user-agent", b"OpenAI/Python 1.54.3"),
            (b"x-stainless-lang", b"python"), (b"x-stainless-package-version", b"1.54.3"),
            (b"x-stainless-runtime-version", b"3.12.1"), (b"x-stainless-retry-count", b"0"),
            (b"content-length", b"%d" % length), (b"traceparent", _traceparent()),
            (b"idempotency-key",
             b"stainless-python-retry-" + str(uuid.UUID(bytes=_R.randbytes(16))).encode())]


def _text(fields: Fields) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in fields]


def _full(target: str, fields: Fields) -> list[tuple[str, str, str]]:
    found = SCANNER.scan_request("POST", target, _text(fields)).findings
    return sorted((f.detector, f.fingerprint, str(f.location)) for f in found)


def _placed(fake: Fake) -> list[Fields]:
    """Heads with the fake credential in a value, beside other text, in a name, encoded,
    among an SDK's fields."""
    value = fake.text.encode("latin-1")
    return [[*_sdk_head(), (b"x-note", value)],
            [(b"authorization", b"Bearer " + value), *_sdk_head()],
            [*_sdk_head()[:3], (value[:60].replace(b":", b"").replace(b" ", b""), b"1"),
             *_sdk_head()[3:]],
            [*_sdk_head(), (b"x-blob", base64.b64encode(value))],
            [*_sdk_head(), (b"x-hex", value.hex().encode())],
            [*_sdk_head(), (b"traceparent", _traceparent() + b" " + value)]]


FAKES = [f for f in CORPUS if not f.opt_in and "\n" not in f.text]


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
@pytest.mark.parametrize("fake", FAKES, ids=lambda f: f.detector)
def test_the_fields_read_find_what_the_whole_head_holds(fake: Fake, warm: bool) -> None:
    """The scan of the fields `unclean` returns finds what the scan of every field
    finds (detector, fingerprint and location), and None is never returned for a head
    the full scan finds something in."""
    for fields in _placed(fake):
        scanner = Scanner(SCANNER.detectors, b"test-salt")
        if warm:
            assert scanner.heads.unclean("POST", "/v1/chat/completions", _sdk_head()) is None
        unclean = scanner.heads.unclean("POST", "/v1/chat/completions", fields)
        full = _full("/v1/chat/completions", fields)
        if unclean is None:
            assert not full, (fake.detector, fields)
            continue
        assert len(unclean) < len(fields) or not warm
        read = scanner.scan_request("POST", "/v1/chat/completions", _text(unclean)).findings
        assert sorted((f.detector, f.fingerprint, str(f.location)) for f in read) == full


def _new_values_only(unclean: Fields | None) -> bool:
    """None, or only the values new each request (16 random bytes hold one of the
    anchors, `AC`, `SK`, ... about once in 2,000 trace ids: then the scan reads it)."""
    return unclean is None or {k for k, _ in unclean} <= {b"traceparent", b"idempotency-key"}


def test_an_sdk_head_is_clean_with_its_new_values_read_once() -> None:
    """What the memory is for: an SDK's head is read for its three new values only, and
    a trace id (hex of 16 random bytes) and an idempotency key are found clean, not
    handed to the scan."""
    heads = CleanParts(SCANNER.prefilter.candidate, SCANNER._holding)
    results = [heads.unclean("POST", "/v1/chat/completions", _sdk_head(1000 + i))
               for i in range(200)]
    assert all(_new_values_only(r) for r in results)
    assert sum(r is None for r in results) >= 190
    assert "POST /v1/chat/completions" in heads.seen
    assert all(p in heads.seen for f in _sdk_head()[:10] for p in f)


@pytest.mark.parametrize("part", [
    _traceparent(), b"stainless-python-retry-" + str(uuid.UUID(bytes=_R.randbytes(16))).encode(),
    b"/v1/chat/completions", b"x-stainless-package-version", b"12345",
    _R.randbytes(16).hex().encode(), b"sha256-" + base64.b64encode(_R.randbytes(32))[:20],
], ids=["traceparent", "idempotency-key", "path", "name", "digits", "uuid-hex", "digest"])
def test_a_part_without_a_value_is_clean_by_the_exact_check(part: bytes) -> None:
    assert not SCANNER._holds(part)
    assert not list(SCANNER.text_hits(part.decode("latin-1"), Location("header", "x")))


def test_the_exact_check_holds_whatever_the_scan_of_the_part_finds() -> None:
    """`_holds` is never False for a part the scan finds something in alone (the fakes,
    encoded, wrapped; random runs of every length around the thresholds)."""
    parts = [f.text.encode("latin-1") for f in FAKES]
    parts += [base64.b64encode(p) for p in parts] + [p.hex().encode() for p in parts]
    parts += [b"k=" + p for p in parts]
    for n in range(8, 80, 3):
        data = _R.randbytes(n)
        parts += [base64.b64encode(data), data.hex().encode(), data.hex().upper().encode()]
    for part in parts:
        found = list(SCANNER.text_hits(part.decode("latin-1"), Location("header", "x")))
        if found:
            assert SCANNER._holds(part), (part, found)
    assert sum(SCANNER._holds(p) for p in parts) >= 3 * len(FAKES)


def test_an_escaped_target_reads_every_field_and_bytearrays_are_never_kept() -> None:
    heads = CleanParts(SCANNER.prefilter.candidate, SCANNER._holding)
    fields = _sdk_head()
    assert heads.unclean("GET", "/x?a=%41", fields) is fields
    raw = [(b"x-raw", bytearray(b"plain"))]
    assert heads.unclean("GET", "/x", raw) is None  # type: ignore[arg-type]
    assert heads.unclean("GET", "/x", raw) is None  # type: ignore[arg-type]
    assert not any(isinstance(p, bytearray) for p in heads.seen)


def test_the_memory_is_bounded() -> None:
    heads = CleanParts(SCANNER.prefilter.candidate, SCANNER._holding)
    for i in range(3 * CLEAN_PARTS):
        assert _new_values_only(heads.unclean("POST", "/v1/chat/completions", _sdk_head(i)))
        assert len(heads.seen) <= CLEAN_PARTS
    long = b"x " * CLEAN_PART
    assert heads.unclean("GET", "/", [(b"x-long", long)]) is None
    assert long not in heads.seen


def test_the_parts_asked_together_answer_as_each_asked_alone() -> None:
    """`_holding` (one search for anchors over the new parts, then each part's runs)
    names exactly the parts `_holds` names one by one: over groups of new values, trace
    ids and idempotency keys beside the fakes, encoded and wrapped, and random runs."""
    pool = [f.text.encode("latin-1") for f in FAKES]
    pool += [base64.b64encode(p) for p in pool] + [p.hex().encode() for p in pool]
    pool += [_traceparent() for _ in range(20)] + [_R.randbytes(16).hex().encode()
                                                   for _ in range(20)]
    pool += [b"stainless-python-retry-" + str(uuid.UUID(bytes=_R.randbytes(16))).encode()
             for _ in range(20)]
    pool += [base64.b64encode(_R.randbytes(n)) for n in range(8, 60, 4)]
    for _ in range(600):
        parts = _R.sample(pool, _R.randrange(1, 5))
        holding = SCANNER._holding(parts, b"\n".join(parts))
        assert holding == [p for p in parts if SCANNER._holds(p)], parts
