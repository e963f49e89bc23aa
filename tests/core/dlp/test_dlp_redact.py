"""`action: redact`: the body comes back without the values and still in its encoding
(JSON parses, a form parses, gzip gunzips, base64 decodes), or with the reason it cannot
be rewritten (the caller refuses)."""

from __future__ import annotations

import base64
import gzip
import json
from urllib.parse import parse_qsl, urlencode

import pytest
import zstandard
from helpers.dlp_corpus import DEFAULT_CORPUS, Fake, fake

from gateway.core.dlp import DEFAULT, REDACTED, Location, Scanner, redact_body, redact_text
from gateway.services.dlp.library import build

SCANNER = Scanner(build(DEFAULT), b"test-salt")


def _chat(text: str) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": f"use {text} please"}]},
                      indent=1).encode()


@pytest.mark.parametrize("fake", DEFAULT_CORPUS, ids=lambda f: f.detector)
def test_json_stays_json_without_the_value(fake: Fake) -> None:
    out = redact_body(SCANNER, _chat(fake.text), "application/json")
    assert out.body is not None and out.replaced >= 1, out.reason
    content = json.loads(out.body)["messages"][0]["content"]
    assert REDACTED in content and content.startswith("use ")
    assert SCANNER.scan_body(out.body, "application/json").clean


@pytest.mark.parametrize("fake", DEFAULT_CORPUS, ids=lambda f: f.detector)
def test_gzip_json_is_recompressed(fake: Fake) -> None:
    out = redact_body(SCANNER, gzip.compress(_chat(fake.text)), "application/json", "gzip")
    assert out.body is not None, out.reason
    assert REDACTED in json.loads(gzip.decompress(out.body))["messages"][0]["content"]


def test_a_form_stays_a_form() -> None:
    key = fake("stripe").text
    out = redact_body(SCANNER, urlencode({"a": "1", "key": key}).encode(),
                      "application/x-www-form-urlencoded")
    assert out.body is not None
    assert dict(parse_qsl(out.body.decode())) == {"a": "1", "key": REDACTED}


def test_base64_inside_json_is_decoded_redacted_and_encoded_again() -> None:
    key = fake("github").text
    blob = base64.b64encode(f"token={key}\n".encode()).decode()
    out = redact_body(SCANNER, json.dumps({"file": blob}).encode(), "application/json")
    assert out.body is not None, out.reason
    inner = base64.b64decode(json.loads(out.body)["file"])
    assert inner == f"token={REDACTED}\n".encode()


def test_zstd_and_multipart() -> None:
    key = fake("huggingface").text
    body = (b"--b\r\nContent-Disposition: form-data; name=\"f\"\r\n\r\nHF_TOKEN="
            + key.encode() + b"\r\n--b--\r\n")
    out = redact_body(SCANNER, zstandard.ZstdCompressor().compress(body),
                      "multipart/form-data; boundary=b", "zstd")
    assert out.body is not None
    plain = zstandard.ZstdDecompressor().decompress(out.body)
    assert plain == body.replace(key.encode(), REDACTED.encode())


def test_what_cannot_be_rewritten_is_said() -> None:
    """A key whose first letter is a JSON escape: a JSON reader reads the key, but its
    bytes are in no form the redactor rewrites; the result says so (the caller refuses)."""
    key = fake("github").text
    body = json.dumps({"k": key}).encode().replace(b'"ghp_', b'"\\u0067hp_')
    assert SCANNER.scan_body(body, "application/json").findings
    out = redact_body(SCANNER, body, "application/json")
    assert out.body is None and out.reason is not None and "cannot" in out.reason
    assert redact_body(SCANNER, b"bad", "application/json", "gzip").body is None


def test_a_clean_body_comes_back_as_it_was() -> None:
    body = gzip.compress(b'{"a": "nothing to see"}')
    out = redact_body(SCANNER, body, "application/json", "gzip")
    assert out.body is body and out.replaced == 0


def test_a_header_value() -> None:
    key = fake("openai").text
    assert redact_text(SCANNER, f"Bearer {key}", Location("header", "X")) == (
        f"Bearer {REDACTED}", 1)


def test_a_credential_in_a_compressed_run_is_not_rewritten() -> None:
    """A credential inside a compressed file in a base64 run (a header's value, a body's
    string) cannot be replaced in the compressed bytes: the caller refuses; a run of a
    very compressible file with none comes back as it was (the head's bound, not its
    own size alone)."""
    env = b"GITHUB_TOKEN=" + fake("github").text.encode() + b"\n"
    packed = base64.b64encode(gzip.compress(env, mtime=0)).decode()
    assert redact_text(SCANNER, packed, Location("header", "X-Blob")) is None
    body = json.dumps({"content": packed}).encode()
    assert redact_body(SCANNER, body, "application/json").body is None
    sparse = base64.b64encode(gzip.compress(b"\0" * 100_000, mtime=0)).decode()
    assert redact_text(SCANNER, sparse, Location("header", "X-Blob")) == (sparse, 0)
