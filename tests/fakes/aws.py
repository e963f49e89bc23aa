"""A local fake of AWS STS and Bedrock runtime over TLS that checks SigV4 signatures the
way AWS does: it recomputes each signature with botocore's SigV4 code and the real
secret key of the access key id named in the request, and refuses any mismatch.

- ``sts.<region>.amazonaws.com``: ``AssumeRole`` (signed with the base key pair, service
  ``sts``) and ``AssumeRoleWithWebIdentity`` (unsigned; the web identity token must
  match) answer temporary credentials (``ASIA…`` + session token, ``Expiration``);
- ``bedrock-runtime.<region>.amazonaws.com`` (service ``bedrock``): ``converse``,
  ``converse-stream`` and ``invoke-with-response-stream``, the streams as binary
  ``application/vnd.amazon.eventstream`` messages (prelude, headers, payload, CRCs).

Checks: the Authorization header's form, the credential scope (date of X-Amz-Date,
region, service), X-Amz-Date within 5 minutes, host signed, a known key (base or
temporary and unexpired), the session token signed and equal to the key's, an
x-amz-content-sha256 digest equal to the body's, and the signature itself. Errors
have AWS's shape (``x-amzn-ErrorType``, ``{"message": …}`` / STS XML).
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import re
import secrets as pysecrets
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from fakes.tlsserver import FakeServer, Reply, Request, json_reply

_AUTH = re.compile(r"AWS4-HMAC-SHA256 Credential=([^/,]+)/(\d{8})/([^/,]+)/([^/,]+)/"
                   r"aws4_request, ?SignedHeaders=([a-z0-9;-]+), ?Signature=([0-9a-f]{64})")


@dataclass
class Key:
    secret: str
    token: str | None = None
    expires: float = float("inf")


def event_message(event_type: str, payload: dict[str, object]) -> bytes:
    """One binary event-stream message (what Bedrock streams)."""
    headers = b""
    for name, value in ((":event-type", event_type), (":content-type", "application/json"),
                        (":message-type", "event")):
        n, v = name.encode(), value.encode()
        headers += bytes([len(n)]) + n + b"\x07" + len(v).to_bytes(2, "big") + v
    body = json.dumps(payload).encode()
    prelude = (12 + len(headers) + len(body) + 4).to_bytes(4, "big") + \
        len(headers).to_bytes(4, "big")
    prelude += zlib.crc32(prelude).to_bytes(4, "big")
    message = prelude + headers + body
    return message + zlib.crc32(message).to_bytes(4, "big")


class FakeAws(FakeServer):
    def __init__(self, directory: Path, region: str = "us-east-1",
                 temp_lifetime: float = 3600.0) -> None:
        self.region = region
        super().__init__(directory, [f"sts.{region}.amazonaws.com",
                                     f"bedrock-runtime.{region}.amazonaws.com", "127.0.0.1"],
                         "fake aws")
        self.base_id = "AKIA" + pysecrets.token_hex(8).upper()
        self.base_secret = pysecrets.token_urlsafe(30)
        self.keys: dict[str, Key] = {self.base_id: Key(self.base_secret)}
        self.role_arn = "arn:aws:iam::123456789012:role/bedrock-agent"
        self.web_identity_token = "eyJweb-identity." + pysecrets.token_urlsafe(20)
        self.temp_lifetime = temp_lifetime
        self.assumed: list[str] = []  # STS actions answered
        self.verified: list[tuple[str, str, str]] = []  # (path, access key id, payload hash)
        self.failures: list[str] = []
        self.bodies: list[bytes] = []

    # -- SigV4 ----------------------------------------------------------------------------

    def verify(self, request: Request, service: str) -> str | None:
        """None if the request's SigV4 signature is right, else why not."""
        found = _AUTH.fullmatch(request.headers.get("authorization", ""))
        if found is None:
            return "missing or malformed Authorization"
        key_id, date, region, svc, signed, signature = found.groups()
        amz_date = request.headers.get("x-amz-date", "")
        if (region, svc) != (self.region, service) or amz_date[:8] != date:
            return f"credential scope {date}/{region}/{svc} is wrong"
        when = dt.datetime.strptime(amz_date, "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.UTC)
        if abs(when.timestamp() - time.time()) > 300:
            return "Signature expired"
        with self.lock:
            key = self.keys.get(key_id)
        if key is None or key.expires < time.time():
            return "The security token included in the request is invalid (unknown key)"
        names = signed.split(";")
        if "host" not in names:
            return "host is not signed"
        if key.token is not None and (request.headers.get("x-amz-security-token") != key.token
                                      or "x-amz-security-token" not in names):
            return "The security token included in the request is invalid"
        claimed = request.headers.get("x-amz-content-sha256")
        if claimed and re.fullmatch(r"[0-9a-f]{64}", claimed) and \
                claimed != hashlib.sha256(request.body).hexdigest():
            return "XAmzContentSHA256Mismatch"
        fields = {n: request.headers.get(n, "") for n in names}
        aws = AWSRequest(method=request.method, url=f"https://{fields['host']}{request.target}",
                         headers=fields, data=request.body)
        aws.context["timestamp"] = amz_date
        auth = SigV4Auth(Credentials(key_id, key.secret, key.token), service, self.region)
        canonical = auth.canonical_request(aws)
        expected = auth.signature(auth.string_to_sign(aws, canonical), aws)
        if not hmac.compare_digest(expected, signature):
            return "The request signature we calculated does not match the signature you " \
                   "provided"
        with self.lock:
            self.verified.append((request.path, key_id, canonical.rsplit("\n", 1)[1]))
        return None

    # -- HTTP -----------------------------------------------------------------------------

    def handle(self, request: Request) -> Reply:
        if request.host.startswith("sts."):
            return self._sts(request)
        problem = self.verify(request, "bedrock")
        if problem is not None:
            with self.lock:
                self.failures.append(problem)
            kind = "ExpiredTokenException" if "expired" in problem else \
                "UnrecognizedClientException" if "token" in problem else \
                "InvalidSignatureException"
            return json_reply(403, {"message": problem}, {"x-amzn-ErrorType": kind})
        with self.lock:
            self.bodies.append(request.body)
        parts = request.path.split("/")
        if len(parts) != 4 or parts[1] != "model":
            return json_reply(404, {"message": "Unknown operation"},
                              {"x-amzn-ErrorType": "UnknownOperationException"})
        text = ["Hello", " from", " Bedrock."]
        usage = {"inputTokens": 5, "outputTokens": 3, "totalTokens": 8}
        if parts[3] == "converse":
            return json_reply(200, {
                "output": {"message": {"role": "assistant",
                                       "content": [{"text": "".join(text)}]}},
                "stopReason": "end_turn", "usage": usage, "metrics": {"latencyMs": 12}})
        stream = "application/vnd.amazon.eventstream"
        if parts[3] == "converse-stream":
            events = [event_message("messageStart", {"role": "assistant"})]
            events += [event_message("contentBlockDelta", {"contentBlockIndex": 0,
                                                           "delta": {"text": t}}) for t in text]
            events += [event_message("contentBlockStop", {"contentBlockIndex": 0}),
                       event_message("messageStop", {"stopReason": "end_turn"}),
                       event_message("metadata", {"usage": usage,
                                                  "metrics": {"latencyMs": 12}})]
            return Reply(200, iter(events), {"Content-Type": stream})
        if parts[3] == "invoke-with-response-stream":
            chunks = [{"type": "content_block_delta", "delta": {"text": t}} for t in text]
            events = [event_message("chunk", {"bytes": base64.b64encode(
                json.dumps(c).encode()).decode()}) for c in chunks]
            return Reply(200, iter(events), {"Content-Type": stream,
                                             "X-Amzn-Bedrock-Content-Type": "application/json"})
        return json_reply(404, {"message": "Unknown operation"},
                          {"x-amzn-ErrorType": "UnknownOperationException"})

    def _sts(self, request: Request) -> Reply:
        form = request.form()
        action = form.get("Action", "")
        if action == "AssumeRole":
            problem = self.verify(request, "sts")
            if problem is not None:
                with self.lock:
                    self.failures.append(problem)
                return _sts_error(403, "SignatureDoesNotMatch", problem)
        elif action == "AssumeRoleWithWebIdentity":
            if form.get("WebIdentityToken") != self.web_identity_token:
                return _sts_error(400, "InvalidIdentityToken", "Couldn't retrieve "
                                  "verification key from your identity provider")
        else:
            return _sts_error(400, "InvalidAction", f"Could not find operation {action}")
        if form.get("RoleArn") != self.role_arn:
            return _sts_error(403, "AccessDenied", "not authorized to perform: "
                              "sts:AssumeRole")
        key_id = "ASIA" + pysecrets.token_hex(8).upper()
        key = Key(pysecrets.token_urlsafe(30), "IQoJb3JpZ2lu" + pysecrets.token_urlsafe(60),
                  time.time() + self.temp_lifetime)
        with self.lock:
            self.keys[key_id] = key
            self.assumed.append(action)
        expiration = dt.datetime.fromtimestamp(key.expires, dt.UTC).strftime(
            "%Y-%m-%dT%H:%M:%SZ")
        body = (f'<{action}Response xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
                f"<{action}Result><Credentials><AccessKeyId>{key_id}</AccessKeyId>"
                f"<SecretAccessKey>{key.secret}</SecretAccessKey>"
                f"<SessionToken>{key.token}</SessionToken><Expiration>{expiration}"
                f"</Expiration></Credentials><AssumedRoleUser><AssumedRoleId>AROA:"
                f"{form.get('RoleSessionName')}</AssumedRoleId><Arn>{self.role_arn}</Arn>"
                f"</AssumedRoleUser></{action}Result><ResponseMetadata><RequestId>r-1"
                f"</RequestId></ResponseMetadata></{action}Response>")
        return Reply(200, body.encode(), {"Content-Type": "text/xml"})

    def temp_keys(self) -> list[tuple[str, Key]]:
        with self.lock:
            return [(k, v) for k, v in self.keys.items() if v.token is not None]


def _sts_error(status: int, code: str, message: str) -> Reply:
    body = (f'<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><Error>'
            f"<Type>Sender</Type><Code>{code}</Code><Message>{message}</Message></Error>"
            "<RequestId>r-1</RequestId></ErrorResponse>")
    return Reply(status, body.encode(), {"Content-Type": "text/xml"})
