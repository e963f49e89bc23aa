"""The SigV4 re-signer: the placeholder signature out, botocore's signature with the real
keys in, checked by recomputing it (tests/fakes/aws.py); which fields are covered; the
payload modes; what is refused."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from fakes.aws import FakeAws, Key
from fakes.tlsserver import Request

from gateway.core.messages import Headers, RequestHead
from gateway.core.refusal import Refusal
from gateway.core.target import Target
from gateway.services.minting.aws import key_set
from gateway.services.minting.sigv4 import SigV4Signer
from gateway.services.policy import load_policy_text

HOST = "bedrock-runtime.us-east-1.amazonaws.com"
POLICY = """
version: v1
name: agent
egress:
  - host: bedrock-runtime.us-east-1.amazonaws.com
    credential: bedrock
credentials:
  bedrock: {type: aws-sigv4, service: bedrock, region: us-east-1, access_key_id: a,
            secret_access_key: b}
"""
CREDENTIAL = load_policy_text("p.yaml", POLICY).credentials["bedrock"]
PLACEHOLDER = ("AWS4-HMAC-SHA256 Credential=SANDBOXGATEWAYPLACEHOLDER/20250101/us-east-1/"
               "bedrock/aws4_request, SignedHeaders=host;x-amz-date, Signature=" + "0" * 64)


@pytest.fixture
def aws(tmp_path: Path) -> FakeAws:
    fake = FakeAws(tmp_path)
    fake.keys["ASIATEMPORARYKEY0001"] = Key("temporary-secret", "the-session-token")
    return fake


def _head(extra: tuple[tuple[str, str], ...] = (),
          target: str = "/model/anthropic.claude-v2%3A1/converse") -> RequestHead:
    return RequestHead("POST", target, Headers.of(
        ("Host", HOST), ("Content-Type", "application/json"), ("Authorization", PLACEHOLDER),
        ("X-Amz-Date", "20250101T000000Z"), ("User-Agent", "Boto3/1.0"),
        ("Connection", "keep-alive"), ("Accept-Encoding", "identity"), *extra), "HTTP/1.1")


def _as_received(head: RequestHead, body: bytes) -> Request:
    fields = {k.lower(): v for k, v in head.headers.items()}
    return Request(head.method, HOST, head.target.split("?")[0], {}, head.target, fields, body)


@pytest.mark.parametrize("token", [None, "the-session-token"])
def test_signed_with_the_real_keys_and_verified(aws: FakeAws, token: str | None) -> None:
    key_id, secret = ("ASIATEMPORARYKEY0001", "temporary-secret") if token else \
        (aws.base_id, aws.base_secret)
    signer = SigV4Signer(CREDENTIAL, key_set(key_id, secret, token, None))
    head, body = _head(), b'{"messages": []}'
    assert signer.needs_body(head)
    signer.sign(head, Target("https", HOST, 443, head.target), body)
    auth = head.headers.get("authorization") or ""
    assert f"Credential={key_id}/" in auth and "PLACEHOLDER" not in auth
    signed = auth.split("SignedHeaders=")[1].split(",")[0]
    assert signed == "content-type;host;x-amz-date" + (";x-amz-security-token" if token else "")
    assert head.headers.get("x-amz-security-token") == token
    assert head.headers.get("x-amz-date") != "20250101T000000Z"
    stamp = dt.datetime.strptime(head.headers.get("x-amz-date") or "", "%Y%m%dT%H%M%SZ")
    assert abs(stamp.replace(tzinfo=dt.UTC).timestamp() - dt.datetime.now(dt.UTC).timestamp()) < 60
    assert aws.verify(_as_received(head, body), "bedrock") is None
    # Fields the engines own may change after signing; the body may not.
    head.headers.set("Connection", "close")
    head.headers.remove("accept-encoding")
    assert aws.verify(_as_received(head, body), "bedrock") is None
    assert "does not match" in (aws.verify(_as_received(head, body + b" "), "bedrock") or "")


def test_a_digest_the_client_sent_is_replaced_by_the_bodys(aws: FakeAws) -> None:
    signer = SigV4Signer(CREDENTIAL, key_set(aws.base_id, aws.base_secret, None, None))
    head = _head((("x-amz-content-sha256", "ab" * 32),))
    assert signer.needs_body(head)
    signer.sign(head, Target("https", HOST, 443, head.target), b"body")
    assert head.headers.get("x-amz-content-sha256") == \
        "230d8358dc8e8890b4c58deeb62912ee2f20357ae92a5cc861b98e68fe31acb5"
    assert aws.verify(_as_received(head, b"body"), "bedrock") is None


@pytest.mark.parametrize("mode", ["UNSIGNED-PAYLOAD", "STREAMING-UNSIGNED-PAYLOAD-TRAILER"])
def test_unsigned_payloads_are_signed_without_the_body(aws: FakeAws, mode: str) -> None:
    signer = SigV4Signer(CREDENTIAL, key_set(aws.base_id, aws.base_secret, None, None))
    head = _head((("x-amz-content-sha256", mode),))
    assert not signer.needs_body(head)
    signer.sign(head, Target("https", HOST, 443, head.target), None)
    assert head.headers.get("x-amz-content-sha256") == mode
    assert aws.verify(_as_received(head, b"anything at all"), "bedrock") is None


@pytest.mark.parametrize(("extra", "target", "code", "words"), [
    ((("x-amz-content-sha256", "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"),), None,
     "unsupported", "UNSIGNED-PAYLOAD"),
    ((("x-amz-content-sha256", "STREAMING-AWS4-ECDSA-P256-SHA256-PAYLOAD-TRAILER"),), None,
     "unsupported", "every chunk"),
    ((("x-amz-content-sha256", "not-a-digest"),), None, "bad_request", "SHA-256"),
    ((), "/model/m/converse?X-Amz-Credential=a&X-Amz-Signature=00", "unsupported",
     "presigned"),
])
def test_what_cannot_be_resigned_is_refused(extra: tuple[tuple[str, str], ...],
                                            target: str | None, code: str,
                                            words: str) -> None:
    signer = SigV4Signer(CREDENTIAL, key_set("AKIAEXAMPLE", "secret", None, None))
    with pytest.raises(Refusal) as info:
        signer.needs_body(_head(extra, target or "/model/m/converse"))
    assert info.value.code == code and words in info.value.reason
