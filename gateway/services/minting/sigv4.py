"""Re-signing a request with AWS Signature Version 4, using botocore's signer.

The sandbox signs with placeholder keys (and its gateway token as the session token,
the carrier the gate checks). Nothing of that signature is verified: the gateway
removes it (``Authorization``, ``X-Amz-Date``, the token) and signs again with the
credential's real keys for its ``service`` and ``region``. Signed are ``host``,
``content-type`` and every ``x-amz-*``/``x-amzn-*`` field: fields the engines own
(``Connection``, framing, ``Accept-Encoding``) stay out, so they may change after.

The payload hash decides when the request can be signed (``x-amz-content-sha256``):

- ``UNSIGNED-PAYLOAD`` and ``STREAMING-UNSIGNED-PAYLOAD-TRAILER`` (aws-chunked with an
  unsigned trailer): the signature does not cover the body; signed at once, the body
  may stream;
- absent or a SHA-256 digest: the body is hashed, so it is held and signed whole
  (a digest the client sent is replaced by the body's own);
- ``STREAMING-AWS4-HMAC-SHA256-PAYLOAD[-TRAILER]`` and the ECDSA variants: every
  chunk carries a signature chained to the placeholder key; refused with a reason.

Presigned URLs (``X-Amz-Signature`` in the query) are refused too. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
import re
from urllib.parse import parse_qsl

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from gateway.core.messages import RequestHead
from gateway.core.policy import Credential
from gateway.core.refusal import Refusal
from gateway.core.secret_value import SecretValue
from gateway.core.target import DEFAULT_PORTS, Target

__all__ = ["SigV4Signer", "signed_field"]

UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
STREAMING_UNSIGNED = "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
_DIGEST = re.compile(r"[0-9a-f]{64}")
_REPLACED = ("authorization", "x-amz-date", "x-amz-security-token")


def signed_field(name: str) -> bool:
    """True for the header fields the gateway's signature covers."""
    lower = name.lower()
    return lower in ("host", "content-type") or lower.startswith(("x-amz-", "x-amzn-"))


class SigV4Signer:
    """Signs requests for one aws-sigv4 credential with its current key set."""

    def __init__(self, credential: Credential, value: SecretValue) -> None:
        assert credential.mint is not None
        keys = json.loads(value.reveal())
        self.name = credential.name
        self.service = credential.mint.text("service") or ""
        self.region = credential.mint.text("region") or ""
        self._credentials = Credentials(keys["access_key_id"], keys["secret_access_key"],
                                        keys.get("session_token"))

    def needs_body(self, head: RequestHead) -> bool:
        query = head.target.partition("?")[2]
        if any(k.lower() in ("x-amz-signature", "x-amz-credential")
               for k, _ in parse_qsl(query, keep_blank_values=True)):
            raise Refusal("unsupported", f"credential {self.name!r} re-signs requests, and "
                          "a presigned URL (X-Amz-Signature in the query) cannot be; send "
                          "the request with an Authorization header instead")
        mode = (head.headers.get("x-amz-content-sha256") or "").strip()
        if mode in (UNSIGNED_PAYLOAD, STREAMING_UNSIGNED):
            return False
        if not mode or _DIGEST.fullmatch(mode.lower()):
            return True
        if mode.startswith("STREAMING-"):
            raise Refusal("unsupported", f"credential {self.name!r}: the client signs every "
                          f"chunk of the body ({mode[:60]}), with keys the gateway replaces; "
                          "configure it for UNSIGNED-PAYLOAD or a whole-body signature "
                          "(botocore: payload_signing_enabled / request_checksum_calculation"
                          " when_required)")
        raise Refusal("bad_request", "x-amz-content-sha256 must be a SHA-256 hex digest, "
                      "UNSIGNED-PAYLOAD or a STREAMING- mode")

    def sign(self, head: RequestHead, target: Target, body: bytes | None) -> None:
        headers = head.headers
        for name in _REPLACED:
            headers.remove(name)
        if body is not None and headers.get("x-amz-content-sha256") is not None:
            headers.set("x-amz-content-sha256", hashlib.sha256(body).hexdigest())
        host = headers.get("host") or head.authority or (
            target.host if target.port == DEFAULT_PORTS[target.scheme]
            else f"{target.host}:{target.port}")
        fields = {k: v for k, v in headers.items() if signed_field(k)}
        request = AWSRequest(method=head.method, url=f"https://{host}{head.target}",
                             headers=fields, data=body or b"")
        SigV4Auth(self._credentials, self.service, self.region).add_auth(request)
        for name in ("Authorization", "X-Amz-Date", "X-Amz-Security-Token"):
            value = request.headers.get(name)
            if value is not None:
                headers.set(name, value)
