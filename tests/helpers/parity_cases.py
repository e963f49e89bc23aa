"""The parity table: every case an engine must answer the same way (see
tests/integration/test_parity.py and test_parity_transparent.py, which run it)."""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import json
import re
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from helpers.dlp_corpus import fake
from helpers.parity import Result, Spec
from helpers.upstream import MCP_ACCESS, MINT_CLIENT, MINT_SECRET, MINTED

KEY = "sk-parity-real-key-0123456789abcdef"
GH = fake("github").text  # a FAKE GitHub token in its real format (issue 43's corpus)
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"  # (AWS's documented example form)
ENGINES = ("h1", "mitmproxy", "h2")
SECRETS = {"openai-api-key": KEY, "parity-client-secret": MINT_SECRET,
           "wrong-client-secret": "not-the-client-secret",
           "parity-aws-id": "AKIAPARITYEXAMPLE0001",
           "parity-aws-secret": "parity/aws/secret/0123456789abcdefghijkl"}
PAD = "x" * (2 << 20)  # a 2 MiB request body: over mitmproxy's own 1 MiB default

POLICY = f"""
version: v1
name: agent
egress:
  - host: allowed.test
  - host: other.test
    paths: ["/ok/secret/**"]
    action: deny
    reason: secrets are not for agents
  - host: other.test
    methods: [GET, POST, HEAD]
    paths: ["/ok/**", "/api/**", "/"]
  - host: other.test
    paths: ["/dlp/**"]
    dlp: {{action: refuse}}
  - host: other.test
    paths: ["/dlp-allow/**"]
    dlp: {{allow: [{{detector: github, hosts: [other.test]}}]}}
  - host: other.test
    paths: ["/dlp-redact/**"]
    dlp: {{action: redact}}
  - host: unbound.test
    paths: ["/mcp", "/mcp/**"]
    mcp:
      tools: {{allow: ["search_*"], deny: ["delete_*"]}}
  - host: unbound.test
    paths: ["/pinned/mcp"]
    mcp:
      tools: {{allow: ["search_*"]}}
      pin_descriptions: true
  - host: unbound.test
    paths: ["/oauth/mcp", "/oauth/other"]
    mcp:
      tools: {{allow: ["*"]}}
      oauth: {{}}
  - host: unbound.test
    paths: ["/oauth/people"]
    mcp:
      tools: {{allow: ["*"]}}
      oauth: {{consent: user}}
  - host: unbound.test
    inspect: true
  - host: api.openai.com
    credential: openai
    models: ["gpt-4o-mini*"]
  - host: 169.254.169.254
  - host: noname.test
  - host: minted.test
    credential: minted
  - host: mintfail.test
    credential: mintfail
  - host: budget.test
    credential: budgeted
  - host: metered.test
    credential: metered
    metering: required
  - host: sigv4.test
    credential: sigv4
  - host: other.test
    paths: ["/dlp-ibm/**"]
    dlp: {{detectors: [cloudant, ibm-cloud-iam, ibm-cos-hmac, softlayer]}}
budgets:
  - {{name: one-call, per: sandbox, window: 24h, requests: 1, credentials: [budgeted]}}
credentials:
  openai: {{preset: openai, secret: openai-api-key}}
  budgeted: {{hosts: [budget.test], secret: openai-api-key, inject: {{bearer: true}}}}
  metered: {{hosts: [metered.test], secret: openai-api-key, inject: {{bearer: true}}}}
  sigv4:
    type: aws-sigv4
    service: bedrock
    region: us-east-1
    access_key_id: parity-aws-id
    secret_access_key: parity-aws-secret
    hosts: [sigv4.test]
  minted:  # minted by the gateway: an OAuth2 client-credentials grant at the upstream
    type: oauth2-client-credentials
    token_url: https://allowed.test/oauth2/token
    client_id: {MINT_CLIENT}
    client_secret: parity-client-secret
    hosts: [minted.test]
  mintfail:  # the token endpoint refuses this client: the mint fails
    type: oauth2-client-credentials
    token_url: https://allowed.test/oauth2/token
    client_id: {MINT_CLIENT}
    client_secret: wrong-client-secret
    hosts: [mintfail.test]
"""
LEARN_POLICY = """
# Learn mode (issue 42): what no rule allows goes, recorded; the credential its own file
# binds to a host is injected; what is never allowed stays refused.
version: v1
name: learner
mode: learn
egress:
  - host: allowed.test
    methods: [GET]
credentials:
  learned: {hosts: [other.test], secret: openai-api-key, inject: {bearer: true}}
"""
POLICIES = {"agent.yaml": POLICY, "learner.yaml": LEARN_POLICY}


@dataclass(frozen=True)
class Case:
    """One row. `see`: (stage, status, code) for the proxy engines; `audit`: the fields
    the deciding audit line must have. `spec` may use {TOKEN}, {KEY}, {PAYLOAD}."""

    name: str
    spec: dict[str, Any]
    see: tuple[str, int | None, str | None]
    audit: dict[str, Any]
    token: str = "valid"  # valid | expired | revoked
    engines: tuple[str, ...] = ENGINES
    transparent: tuple[str, int | None, str | None] | None = None  # what a redirected
    # sandbox sees, when it differs (refused before TLS: no HTTP answer); "skip" = n/a
    check: Callable[[Result, list[Any]], None] | None = None  # result, upstream requests
    prime: str = ""  # a case run first (a swap that fetches or mints the value), after
    # its own prime (`primes`)
    # mitmproxy streams a body of unknown size to the upstream as it arrives: a refusal
    # found in it over HTTP/1 can only cut the connection (no answer fits mid-stream),
    # where the HTTP/1 engine, which holds a body until it is checked, still answers 403;
    # over HTTP/2 that stream alone is answered 403 (patches.install_stream_refusal).
    streamed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    # Audit lines the case writes: one per exchange or tunnel; two where a refusal sits
    # inside something that goes on (a tunnel's first bytes, a WebSocket message).
    lines: int = 1
    policy: str = "agent"  # the policy the case's token names
    # an MCP OAuth consent the case's request is held for: completed meanwhile as a
    # person's browser would (helpers/mcp_consent.py)
    consent: bool = False


def primes(case: Case) -> list[Case]:
    """The cases to run before `case`, first first (its prime, after that one's own)."""
    chain: list[Case] = []
    while case.prime:
        case = next(c for c in CASES if c.name == case.prime)
        chain.insert(0, case)
    return chain


def _no_upstream(result: Result, seen: list[Any]) -> None:
    assert seen == [], [s.path for s in seen]


def _no_upstream_body(result: Result, seen: list[Any]) -> None:
    """Nothing arrived, or (a streamed body cut off) no complete request."""
    assert all(s.body == b"" and "eyJ" not in json.dumps(s.headers) for s in seen), seen


def _upstream_gunzips_to(data: bytes, seen: list[Any]) -> None:
    """One request arrived, its body (gzip, as sent) `data` decoded."""
    assert len(seen) == 1 and gzip.decompress(seen[0].body) == data, seen


def _upstream_exactly(method: str, path: str, body: bytes) -> Callable[[Result, list[Any]], None]:
    def check(result: Result, seen: list[Any]) -> None:
        assert [(s.method, s.path, s.body) for s in seen] == [(method, path, body)], seen
    return check


STREAMABLE = ["Accept", "application/json, text/event-stream"]  # a streamable-HTTP client
PINNED = "MCP: a pinned tool's first listing"
CHANGED = "MCP: a pinned tool listed with another description is left out"
LIST_TOOLS = '{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}'


def _no_tools_listed(result: Result, seen: list[Any]) -> None:
    """The server listed its tool (changed): the client got an empty list."""
    assert len(seen) == 1 and b"tools/list" in seen[0].body, seen
    assert json.loads(result.body)["result"]["tools"] == [], result.body


def _relayed_ping(result: Result, seen: list[Any]) -> None:
    """The server saw a ping under a marked id, nothing of the refused call."""
    assert len(seen) == 1 and b"delete_repo" not in seen[0].body, seen
    ping = json.loads(seen[0].body)
    assert ping["method"] == "ping" and ping["id"].startswith("sandbox-gateway-refused:")


def _sse_data(body: str) -> list[Any]:
    """The JSON-RPC messages of an event stream as the gateway writes it (LF only)."""
    assert "\r" not in body, body
    return [json.loads(line[6:]) for line in body.split("\n") if line.startswith("data: ")]


def _messages(body: str) -> list[Any]:
    """The messages of an answer, JSON or an event stream."""
    if body.lstrip().startswith(("{", "[")):
        doc = json.loads(body)
        return doc if isinstance(doc, list) else [doc]
    return _sse_data(body)


def _listed_only_allowed(result: Result, seen: list[Any]) -> None:
    """The server listed search_issues and delete_repo; the client read only the first."""
    answers = [m for m in _messages(result.body) if "result" in m]
    assert [[t["name"] for t in m["result"]["tools"]] for m in answers] == \
        [["search_issues"]], result.body
    assert answers[0]["id"] in (102, 1)


def _answer_refused(result: Result, seen: list[Any]) -> None:
    """The server's answer did not reach the client: a JSON-RPC error for request 102
    (by its own id, 102 the integer) in its place, nothing of the tools."""
    errors = _messages(result.body)
    assert [(e["id"], e["error"]["data"]["code"]) for e in errors] == \
        [(102, "upstream_failed")], result.body
    assert "delete_repo" not in result.body and "ssh" not in result.body


def _ws_refused_call(result: Result, seen: list[Any]) -> None:
    """The call never reached the server; the client read its JSON-RPC error."""
    assert [s.body for s in seen if s.method == "WS"] == [], seen
    error = json.loads(result.body)
    assert error["id"] == 1 and error["error"]["data"]["code"] == "mcp_denied", error
    assert "delete_repo" in error["error"]["message"]


def _ws_listed(result: Result, seen: list[Any]) -> None:
    assert len([s for s in seen if s.method == "WS"]) == 1, seen
    _listed_only_allowed(result, seen)


def _swapped(result: Result, seen: list[Any]) -> None:
    assert seen and seen[-1].headers.get("authorization") == f"Bearer {KEY}"
    assert "eyJ" not in json.dumps(seen[-1].headers)  # no gateway token upstream
    assert KEY not in result.body and KEY not in json.dumps(result.headers)
    assert "[REDACTED]" in result.body


def _learned_swapped(result: Result, seen: list[Any]) -> None:
    """Learn mode injected the credential its policy binds to the host."""
    assert seen and seen[-1].headers.get("authorization") == f"Bearer {KEY}"
    assert "eyJ" not in json.dumps(seen[-1].headers)


def _minted_swapped(result: Result, seen: list[Any]) -> None:
    assert seen and seen[-1].headers.get("authorization") == f"Bearer {MINTED}"
    assert "eyJ" not in json.dumps(seen[-1].headers)
    assert MINTED not in result.body and MINTED not in json.dumps(result.headers)
    assert "[REDACTED]" in result.body


def _only_the_mint(result: Result, seen: list[Any]) -> None:
    """The failed grant reached the token endpoint; nothing reached the API host."""
    assert all(s.path == "/oauth2/token" for s in seen), [s.path for s in seen]
    assert "not-the-client-secret" not in result.body


def _ws_relayed(result: Result, seen: list[Any]) -> None:
    assert [s.body for s in seen if s.method == "WS"] == [b"hello"]
    assert result.body == "hello"


def _ws_redacted(result: Result, seen: list[Any]) -> None:
    assert [s.body for s in seen if s.method == "WS"] == [KEY.encode()]  # its own host
    assert KEY not in result.body and "[REDACTED]" in result.body


def _no_ws_message(result: Result, seen: list[Any]) -> None:
    assert [s.body for s in seen if s.method == "WS"] == [], seen
    assert result.body == ""


def _no_key(result: Result, seen: list[Any]) -> None:
    assert KEY not in result.body and KEY not in json.dumps(result.headers)


def _no_key_wide(result: Result, seen: list[Any]) -> None:
    """Not in the answer, nor in its text read as UTF-16 (a NUL between characters)."""
    _no_key(result, seen)
    assert KEY not in result.body.replace("\x00", "")


def _no_key_gunzipped(result: Result, seen: list[Any]) -> None:
    """Not in the answer, nor in what gunzip makes of it (the client may undo it)."""
    _no_key(result, seen)
    raw = result.body.encode("latin-1")
    if raw.startswith(b"\x1f\x8b"):
        assert KEY.encode() not in gzip.decompress(raw)


def _both_members(result: Result, seen: list[Any]) -> None:
    """The key redacted, and the answer whole: its second member's text is there (only
    the first was decoded, and the rest dropped)."""
    _no_key_gunzipped(result, seen)
    raw = result.body.encode("latin-1")
    text = gzip.decompress(raw) if raw.startswith(b"\x1f\x8b") else raw
    assert text.startswith(b"first member\n") and b'{"value": ' in text, text[:200]


def _whole_body(size: int, model: str) -> Callable[[Result, list[Any]], None]:
    """The upstream got the whole body, once, as sent."""
    def check(result: Result, seen: list[Any]) -> None:
        assert len(seen) == 1 and len(seen[0].body) >= size, [len(s.body) for s in seen]
        assert json.loads(seen[0].body)["model"] == model
    return check


def _usage_asked(result: Result, seen: list[Any]) -> None:
    """The streamed call reached the upstream asking for its usage (whatever the path's
    spelling or the body's coding)."""
    assert len(seen) == 1, seen
    body = seen[0].body
    if seen[0].headers.get("content-encoding") == "gzip":
        body = gzip.decompress(body)
    assert json.loads(body)["stream_options"] == {"include_usage": True}


def _signed_over_the_body(result: Result, seen: list[Any]) -> None:
    assert len(seen) == 1 and len(seen[0].body) >= len(PAD), seen
    headers = seen[0].headers
    assert headers["authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKIAPARITY")
    assert headers["x-amz-content-sha256"] == hashlib.sha256(seen[0].body).hexdigest()
    assert "eyJ" not in json.dumps(headers)


def _error_event(code: str) -> Callable[[Result, list[Any]], None]:
    """A refused WebSocket message: the sandbox got the provider's error event, the
    upstream never got the message."""
    def check(result: Result, seen: list[Any]) -> None:
        assert [s.body for s in seen if s.method == "WS"] == [], seen
        event = json.loads(result.body)
        assert event["type"] == "error" and event["error"]["code"] == code, event
    return check


def _gz(text: str) -> str:
    return base64.b64encode(gzip.compress(text.encode())).decode()


def _zst(text: str) -> str:
    """`text` zstd-compressed, base64 (PEP 784's encoder: the gateway reads it since the
    twenty-first session)."""
    from backports import zstd

    return base64.b64encode(zstd.compress(text.encode())).decode()


def _pzst(data: bytes, skipped: int = 4) -> bytes:
    """`data` as pzstd writes it: a skippable frame first (its 4 bytes: the frame's size),
    then the zstd frame; neither check took it for a zstd file before the twenty-second
    session. `skipped`: other than 4 bytes in the skippable frame, so that the zstd
    frame's base64 does not start at a group's start (the leak guard found a frame's
    start there: `KLUv/`)."""
    from backports import zstd

    frame = zstd.compress(data)
    return struct.pack("<III", 0x184D2A50, skipped, len(frame)) + bytes(skipped - 4) + frame


def _grpc_gz(text: str) -> str:
    """A gRPC body of two messages, the second gzip-compressed holding `text`, base64."""
    return base64.b64encode(_grpc_messages(text)).decode()


def _grpc_text(text: str) -> str:
    """`_grpc_gz`'s messages in gRPC-Web's text form (each base64 on its own, the first
    padded), base64."""
    body = _grpc_messages(text)
    return base64.b64encode(base64.b64encode(body[:11]) + base64.b64encode(body[11:])).decode()


def _git_push(text: str) -> str:
    """A git push (the ref update, then a pack of one blob holding `text`, deflated as
    git deflates it), base64."""
    data, size = text.encode(), len(text.encode())
    head = bytearray([0x30 | size & 0x0F | (0x80 if size > 0x0F else 0)])
    size >>= 4
    while size:
        head.append(size & 0x7F | (0x80 if size > 0x7F else 0))
        size >>= 7
    pack = b"PACK\0\0\0\2\0\0\0\1" + bytes(head) + zlib.compress(data)
    line = b"0" * 40 + b" " + b"1" * 40 + b" refs/heads/main\0report-status\n"
    body = b"%04x" % (len(line) + 4) + line + b"0000" + pack + hashlib.sha1(pack).digest()
    return base64.b64encode(body).decode()


@functools.cache
def _filler(size: int) -> str:
    """`size` characters of random lowercase words (no detector reads them; gzip cannot
    shrink them much), the same in every process; made once a process."""
    import random

    rng = random.Random(size)
    return "".join(rng.choices("abcdefghijklmnopqrstuvwxyz ", k=size))


def _tar_gz(text: str, filler: int = 0) -> str:
    """A `.tar.gz` of a README (`filler` bytes of random lowercase words, which no
    detector reads and gzip cannot shrink much) and a `.env` holding `text`, base64;
    made the same in every process (mtime 0, a seeded filler)."""
    import io
    import tarfile

    readme = _filler(filler) or "hi"
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in (("README", readme.encode()), (".env", text.encode())):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    return base64.b64encode(gzip.compress(raw.getvalue(), mtime=0)).decode()


def _zip(text: str, filler: int = 0) -> str:
    """A `.zip` (deflate) of a README (`filler` bytes of random lowercase words, as in
    `_tar_gz`) and a `.env` holding `text`, base64."""
    import io
    import zipfile

    readme = _filler(filler)
    raw = io.BytesIO()
    with zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in (("README", readme or "notes\n" * 50), (".env", text)):
            archive.writestr(zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0)), data,
                             zipfile.ZIP_DEFLATED)
    return base64.b64encode(raw.getvalue()).decode()


def _image_zip(text: str, filler: int = 0) -> str:
    """An image that is also a zip (`_zip`'s, after a PNG's first bytes and 1,000 of
    its data: `unzip` extracts it, warning of the bytes before), base64."""
    return base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(range(250)) * 4 + base64.b64decode(
        _zip(text, filler))).decode()


def _upload_form(text: str, filler: int = 0) -> str:
    """An upload form (boundary `b`; an S3 presigned POST's shape): a `key` field, then
    the file, `_zip`'s archive, base64."""
    return base64.b64encode(
        b"--b\r\nContent-Disposition: form-data; name=\"key\"\r\n\r\nuploads/ws.zip\r\n"
        b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"ws.zip\"\r\n"
        b"Content-Type: application/zip\r\n\r\n" + base64.b64decode(_zip(text, filler)) +
        b"\r\n--b--\r\n").decode()


def _grpc_messages(text: str) -> bytes:
    def frame(message: bytes, compressed: int) -> bytes:
        return bytes([compressed]) + len(message).to_bytes(4, "big") + message
    data, size, varint = text.encode(), len(text.encode()), b""
    while True:  # (protobuf's length: a varint)
        varint += bytes([size & 0x7F | (0x80 if size > 0x7F else 0)])
        size >>= 7
        if not size:
            break
    return frame(b"\x0a\x04helo", 0) + frame(gzip.compress(b"\x0a" + varint + data, mtime=0), 1)


def _gz_members(text: str) -> str:
    """A gzip body of two members (RFC 1952 2.2): some prose, then `text`, base64."""
    return base64.b64encode(gzip.compress(b"notes for the build\n") +
                            gzip.compress(text.encode())).decode()


def _multipart_gz(text: str) -> str:
    """A multipart form (boundary `b`) of 2 MiB of padding and a gzip-coded part of
    `text`, base64."""
    body = (b"--b\r\nContent-Disposition: form-data; name=\"pad\"\r\n\r\n" +
            b"x" * (2 << 20) + b"\r\n--b\r\nContent-Disposition: form-data; name=\"f\"\r\n"
            b"Content-Encoding: gzip\r\n\r\n" + gzip.compress(text.encode()) +
            b"\r\n--b--\r\n")
    return base64.b64encode(body).decode()


def _b64(text: str, codec: str = "utf-8") -> str:
    return base64.b64encode(text.encode(codec)).decode()


def _json_file(text: str, how: str, filler: int = 0, inside: int = 0) -> str:
    """A JSON body sending a file in a string, as GitHub's contents API takes one
    (base64), the file holding `text`: gzipped (`gz`), or in base64 lines of 76 (`lines`,
    `text` placed so a line break cuts it), or zstd-compressed (`zst`, `pzst` as pzstd
    writes it, `skipzst` with a skippable frame of 5 bytes: `_pzst`); `filler`: a
    string of random words before it (past the hold limit: streamed); `inside`: random
    words in the file before `text` (2 MiB: a run of 1.6 MB, past what a stream read
    kept whole before the twenty-first session). Base64, for the spec."""
    data = (_filler(inside) + "#" * 33 + "\n" + text).encode()
    if how.startswith("pngzip"):  # (an image that is also a zip, its zip's signature at
        import random  # byte 0, 1 or 2 of a base64 group: `pngzip0` to `pngzip2`;
        # `pngzipM`: 1.5 MB of the image first, a run no window holds whole)
        size = (1_500_000 if how.endswith("M") else 1000)
        size += (int(how[6]) - 8 - size) % 3
        image = b"\x89PNG\r\n\x1a\n" + random.Random(5).randbytes(size)
        content = base64.b64encode(image + base64.b64decode(_zip(data.decode()))).decode()
    elif how in ("gz", "zst", "pzst", "skipzst"):
        packed = gzip.compress(data, mtime=0) if how == "gz" else _pzst(data) \
            if how == "pzst" else _pzst(data, 5) if how == "skipzst" else \
            base64.b64decode(_zst(data.decode()))
        content = base64.b64encode(packed).decode()
    else:
        encoded = base64.b64encode(data).decode()
        content = "\n".join(encoded[i:i + 76] for i in range(0, len(encoded), 76))
    return _b64(json.dumps({"message": "add .env", "pad": _filler(filler),
                            "content": content}))


DENY = {"decision": "deny"}
# A Realtime `response.done` server event (sent by the client, echoed by the upstream).
REALTIME_DONE = json.dumps({"type": "response.done", "response": {"status": "completed", "usage": {
    "total_tokens": 10, "input_tokens": 7, "output_tokens": 3,
    "input_token_details": {"cached_tokens": 2}}}})
WS_UPGRADE = [["Upgrade", "websocket"], ["Connection", "Upgrade"],
              ["Sec-WebSocket-Version", "13"], ["Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="]]
SWAP, MINT = "key swap, echo redacted", "minted token swap, echo redacted"
BUDGETED = "a budgeted call"
CONNECT_DENY = {"decision": "deny", "method": "CONNECT"}
# A validly signed token refused for time or revocation is named on its audit line.
NAMED = {"sandbox": "sandbox-1", "policy": "agent"}

MCP_CALL = '{{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {{"name": {name}}}}}'
MCP_LIST = "{B64:{\"jsonrpc\": \"2.0\", \"id\": 102, \"method\": \"tools/list\"}}"


def _mcp_post(body: str, target: str = "/mcp", method: str = "POST") -> dict[str, Any]:
    return {"host": "unbound.test", "method": method, "target": target,
            "headers": [["Content-Type", "application/json"], STREAMABLE],
            "body": "{B64:" + body + "}"}


def _mcp_answer_case(name: str, shape: str, see: tuple[str, int | None, str | None],
                     refused: bool) -> Case:
    """A tools/list answered by the upstream in `shape` (tests/helpers/upstream.py)."""
    spec = {**_mcp_post("", f"/mcp/answer/{shape}"), "body": MCP_LIST}
    return Case(name, spec, see, {**DENY, "error": "upstream_failed", "status": 200}
                if refused else {"decision": "allow", "error": None},
                check=_answer_refused if refused else _listed_only_allowed)


def _mcp_ambiguous(name: str, body: str) -> Case:
    """A body the gateway and a server could read differently: refused unread."""
    return Case(f"MCP: {name}", _mcp_post(body), ("response", 403, "mcp_denied"),
                {**DENY, "error": "mcp_denied"}, check=_no_upstream)


# Issue 40: an MCP policy a hostile server (or sandbox) cannot talk around.
MCP_WIRE = [
    # 1. Every request to an mcp: host is decided, whatever its transport.
    Case("MCP: a WebSocket call the rule denies",
         {"host": "unbound.test", "target": "/mcp", "headers": WS_UPGRADE,
          "ws": [MCP_CALL.format(name='"delete_repo"')]},
         ("ws-echo", 101, None), {**DENY, "error": "mcp_denied"},
         engines=("h1", "mitmproxy"), check=_ws_refused_call, lines=2),
    Case("MCP: a WebSocket tools/list is filtered",
         {"host": "unbound.test", "target": "/mcp/ws", "headers": WS_UPGRADE,
          "ws": ['{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}']},
         ("ws-echo", 101, None), {"decision": "allow", "error": None},
         engines=("h1", "mitmproxy"), check=_ws_listed),
    Case("MCP: a PUT carrying a denied call is refused",
         _mcp_post(MCP_CALL.format(name='"delete_repo"'), method="PUT"),
         ("response", 403, "mcp_denied"), {**DENY, "error": "mcp_denied", "method": "PUT"},
         check=_no_upstream),
    Case("MCP: a GET carrying a call is refused",
         _mcp_post(MCP_CALL.format(name='"delete_repo"'), method="GET"),
         ("response", 403, "mcp_denied"), {**DENY, "error": "mcp_denied", "method": "GET"},
         check=_no_upstream),
    # 2. Answers the gateway cannot read are not passed on.
    _mcp_answer_case("MCP: a tools/list answer lists only the allowed tools", "json",
                     ("response", 200, None), refused=False),
    _mcp_answer_case("MCP: a tools/list event lists only the allowed tools", "sse",
                     ("response", 200, None), refused=False),
    _mcp_answer_case("MCP: events ended by LF CR are each read", "sse-lfcr",
                     ("response", 200, None), refused=False),
    _mcp_answer_case("MCP: an event that is not UTF-8 is not passed on", "sse-utf8",
                     ("response", 200, None), refused=True),
    _mcp_answer_case("MCP: an answer under the id's string is not passed on", "json-strid",
                     ("response", 200, None), refused=True),
    _mcp_answer_case("MCP: an answer that is not JSON by its media type is not passed on",
                     "json-plain", ("response", 200, "upstream_failed"), refused=True),
    # 3. What the gateway and a server could read differently is refused.
    _mcp_ambiguous("a repeated method", '{"jsonrpc": "2.0", "id": 1, "method": "ping", '
                   '"method": "tools/call", "params": {"name": "delete_repo"}}'),
    _mcp_ambiguous("METHOD beside method", '{"jsonrpc": "2.0", "id": 1, "method": "ping", '
                   '"METHOD": "tools/call", "params": {"name": "delete_repo"}}'),
    _mcp_ambiguous("a repeated name", MCP_CALL.format(
        name='"search_issues", "name": "delete_repo"')),
    _mcp_ambiguous("NAME beside name", MCP_CALL.format(
        name='"search_issues", "NAME": "delete_repo"')),
    _mcp_ambiguous("a null method then a real one", '{"jsonrpc": "2.0", "id": 1, '
                   '"method": null, "method": "tools/call", "params": {"name": "delete_repo"}}'),
    _mcp_ambiguous("a repeated argument", MCP_CALL.format(
        name='"search_issues", "arguments": {"q": "a", "q": "b"}')),
]

# Issue 44: an MCP server requiring OAuth (tests/helpers/upstream.py `/oauth/mcp`), the
# gateway its client. The consent's browser is not modelled in the transparent lab.
OAUTH_GRANTED = "MCP OAuth: one consent, then the call with the gateway's token"
OAUTH = {"decision": "allow", "host": "unbound.test", "error": None,
         "rule": "policies/agent.yaml:31"}


def _oauth_post(target: str, *headers: list[str]) -> dict[str, Any]:
    return {**_mcp_post(MCP_CALL.format(name='"search_issues"'), target),
            "headers": [["Content-Type", "application/json"], STREAMABLE, *headers]}


def _only_discovery(result: Result, seen: list[Any]) -> None:
    """The gateway read the server's metadata (GETs), and sent nothing of the request."""
    assert seen and all(s.method == "GET" and s.path.startswith("/.well-known/")
                        for s in seen), [(s.method, s.path) for s in seen]


def _sent_with_the_grant(result: Result, seen: list[Any]) -> None:
    """The server got the call with the gateway's token; the client never saw it."""
    calls = [s for s in seen if s.path == "/oauth/mcp"]
    assert [s.headers.get("authorization") for s in calls] == [f"Bearer {MCP_ACCESS}"], seen
    assert MCP_ACCESS not in result.body


MCP_OAUTH = [
    Case("MCP OAuth: a token the sandbox sends itself is refused",
         _oauth_post("/oauth/mcp", ["Authorization", "Bearer sandbox-own-token"]),
         ("response", 403, "mcp_token_refused"),
         {**DENY, "error": "mcp_token_refused", "host": "unbound.test"}, check=_no_upstream),
    Case("MCP OAuth: consent per user, a token naming no user is refused",
         _oauth_post("/oauth/people"), ("response", 403, "mcp_user_required"),
         {**DENY, "error": "mcp_user_required", "host": "unbound.test"}, check=_no_upstream),
    Case("MCP OAuth: metadata naming another resource is refused",
         _oauth_post("/oauth/other"), ("response", 502, "mcp_oauth_failed"),
         {**DENY, "error": "mcp_oauth_failed", "host": "unbound.test"},
         check=_only_discovery),
    Case(OAUTH_GRANTED, _oauth_post("/oauth/mcp"), ("response", 200, None),
         {**OAUTH, "status": 200}, consent=True, check=_sent_with_the_grant,
         transparent=("skip", None, None)),
    Case("MCP OAuth: a token the server refuses goes back to consent",
         _oauth_post("/oauth/mcp", ["X-Refuse", "1"]), ("response", 403,
                                                         "mcp_consent_required"),
         {**DENY, "error": "mcp_consent_required", "host": "unbound.test"},
         prime=OAUTH_GRANTED, check=_sent_with_the_grant, transparent=("skip", None, None)),
]

LEARN = {"decision": "report", "rule": None, "error": None, "path_taken": "intercept"}
LEARN_CASES = [
    Case("learn: a host no rule names goes, intercepted and recorded",
         {"host": "unbound.test", "target": "/v1/x"}, ("response", 200, None),
         {**LEARN, "host": "unbound.test", "method": "GET", "path": "/v1/x", "status": 200},
         policy="learner"),
    Case("learn: a method its rule refuses goes, recorded",
         {"host": "allowed.test", "method": "POST", "target": "/p"},
         ("response", 200, None), {**{k: v for k, v in LEARN.items() if k != "rule"},
                                  "method": "POST"}, policy="learner"),
    Case("learn: the credential bound to the host is injected and named",
         {"host": "other.test", "target": "/echo-header/Authorization",
          "headers": [["Authorization", "Bearer {TOKEN}"]]}, ("response", 200, None),
         {"decision": "report", "credential": "learned", "status": 200}, policy="learner",
         check=_learned_swapped),
    Case("learn: the token to a host without a credential is still refused",
         {"host": "unbound.test", "headers": [["X-Steal", "{TOKEN}"]]},
         ("response", 403, "exfiltration_blocked"),
         {**DENY, "error": "exfiltration_blocked", "host": "unbound.test"}, policy="learner",
         check=_no_upstream),
    Case("learn: a forbidden destination is still refused",
         {"host": "169.254.169.254"}, ("connect", 403, "forbidden_destination"),
         {**CONNECT_DENY, "error": "forbidden_destination"}, policy="learner",
         check=_no_upstream),
]
LEARN_CASES = [replace(c, transparent=("skip", None, None)) for c in LEARN_CASES]

CASES = [
    Case("allow inspected", {"host": "other.test", "target": "/ok/a"},
         ("response", 200, None),
         {"decision": "allow", "host": "other.test", "port": 443, "path": "/ok/a",
          "status": 200, "path_taken": "intercept", "error": None}),
    Case("allow passthrough", {"host": "allowed.test", "target": "/p"},
         ("response", 200, None),
         {"decision": "allow", "host": "allowed.test", "port": 443, "method": "CONNECT",
          "path_taken": "passthrough"}, engines=("h1", "mitmproxy"),
         extra={"upstream_ca": True}),
    Case("deny host", {"host": "evil.test"}, ("connect", 403, "policy_denied"),
         {**CONNECT_DENY, "error": "policy_denied", "host": "evil.test"},
         transparent=("tls", None, None), check=_no_upstream),
    Case("deny port", {"host": "other.test", "port": 8443},
         ("connect", 403, "policy_denied"),
         {**CONNECT_DENY, "error": "policy_denied", "host": "other.test", "port": 8443},
         transparent=("skip", None, None)),
    Case("deny method", {"host": "other.test", "method": "DELETE", "target": "/ok/a"},
         ("response", 403, "policy_denied"),
         {**DENY, "error": "policy_denied", "method": "DELETE", "path": "/ok/a"},
         check=_no_upstream),
    Case("deny path", {"host": "other.test", "target": "/admin"},
         ("response", 403, "policy_denied"), {**DENY, "error": "policy_denied"},
         check=_no_upstream),
    Case("deny rule on a path", {"host": "other.test", "target": "/ok/secret/a"},
         ("response", 403, "policy_denied"), {**DENY, "error": "policy_denied"},
         check=_no_upstream),
    Case("dot segments around a deny rule's path", {"host": "other.test",
                                                   "target": "/ok/x/../secret/a"},
         ("response", 403, "policy_denied"), {**DENY, "error": "policy_denied"},
         check=_no_upstream),
    Case("F11 dot segment behind a path parameter",
         {"host": "other.test", "target": "/api/..;/admin"},
         ("response", 403, "policy_denied"), {**DENY, "error": "policy_denied"},
         check=_no_upstream),
    Case("F11 fullwidth dots", {"host": "other.test", "target": "/api/%ef%bc%8e%ef%bc%8e/x"},
         ("response", 403, "policy_denied"), {**DENY, "error": "policy_denied"},
         check=_no_upstream),
    Case("Host names another host", {"host": "other.test", "target": "/ok/a",
                                      "headers": [["Host", "unbound.test"]]},
         ("response", 403, "host_mismatch"), {**DENY, "error": "host_mismatch"},
         engines=("h1", "mitmproxy"), check=_no_upstream),
    Case("F2 absolute-form names another host",
         {"host": "unbound.test", "target": "https://api.openai.com/x",
          "headers": [["Host", "unbound.test"]]},
         ("response", 403, "host_mismatch"), {**DENY, "error": "host_mismatch"},
         engines=("h1", "mitmproxy"), check=_no_upstream),
    Case(":authority names another host", {"host": "other.test", "target": "/ok/a",
                                           "authority": "unbound.test"},
         ("response", 403, "host_mismatch"), {**DENY, "error": "host_mismatch"},
         engines=("h2",), check=_no_upstream),
    Case("SNI names another host", {"host": "other.test", "sni": "unbound.test"},
         ("tls", None, None), {**CONNECT_DENY, "error": "host_mismatch",
                               "host": "other.test"},
         transparent=("skip", None, None), check=_no_upstream),
    Case("F10 SNI fronting on passthrough", {"host": "allowed.test", "sni": "evil.test"},
         ("tls", None, None), {**CONNECT_DENY, "error": "host_mismatch", "host": "allowed.test"},
         engines=("h1", "mitmproxy"), transparent=("skip", None, None), check=_no_upstream,
         lines=2),
    Case("key swap, echo redacted",
         {"host": "api.openai.com", "target": "/echo-header/Authorization",
          "headers": [["Authorization", "Bearer {TOKEN}"]]},
         ("response", 200, None),
         {"decision": "allow", "credential": "openai", "status": 200}, check=_swapped),
    Case("token to an unbound host in a header",
         {"host": "unbound.test", "headers": [["X-Steal", "{TOKEN}"]]},
         ("response", 403, "exfiltration_blocked"),
         {**DENY, "error": "exfiltration_blocked", "host": "unbound.test"},
         check=_no_upstream),
    Case("token in a second header on the credential's host",
         {"host": "api.openai.com", "target": "/v1/models",
          "headers": [["Authorization", "Bearer {TOKEN}"], ["X-Steal", "{TOKEN}"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    Case("key sent back to the credential's own host", {
         "host": "api.openai.com", "target": "/v1/models",
         "headers": [["Authorization", "Bearer {TOKEN}"], ["X-K", "{KEY}"]]},
         ("response", 200, None), {"decision": "allow", "credential": "openai"},
         prime=SWAP),
    Case("WebSocket message relayed", {"host": "other.test", "target": "/ok/ws",
                                       "headers": WS_UPGRADE, "ws": ["hello"]},
         ("ws-echo", 101, None), {"decision": "allow", "host": "other.test"},
         engines=("h1", "mitmproxy"), check=_ws_relayed),
    Case("key echoed in a WebSocket message",
         {"host": "api.openai.com", "target": "/ws", "ws": ["{KEY}"],
          "headers": [["Authorization", "Bearer {TOKEN}"], *WS_UPGRADE]},
         ("ws-echo", 101, None), {"decision": "allow", "credential": "openai"},
         engines=("h1", "mitmproxy"), prime=SWAP, check=_ws_redacted),
    Case("token in a WebSocket message", {"host": "unbound.test", "target": "/ws",
                                          "headers": WS_UPGRADE, "ws": ["x {TOKEN} y"]},
         ("ws-closed", 101, None), {**DENY, "error": "exfiltration_blocked"},
         engines=("h1", "mitmproxy"), check=_no_ws_message),
    Case("token in the query", {"host": "unbound.test", "target": "/q?t={TOKEN}"},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    Case("token in the body", {"host": "unbound.test", "method": "POST", "target": "/b",
                               "body": "{B64:{\"t\": \"{TOKEN}\"}}"},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    Case("F4 token in a trailer", {"host": "unbound.test", "method": "POST", "target": "/t",
                                   "body": "{B64:hello}", "chunked": True,
                                   "trailers": [["X-Trailer", "{TOKEN}"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         streamed=True, check=_no_upstream_body, engines=("h1", "h2")),
    # A body of unknown length (HTTP/1 chunked; HTTP/2 without Content-Length) reaches an
    # HTTP/1 upstream framed: mitmproxy sent an HTTP/2 one unframed, and the upstream read
    # its bytes as a second request no policy decided (patches.install_h1_framing).
    Case("a streamed body of unknown length reaches the upstream framed",
         {"host": "other.test", "method": "POST", "target": "/ok/framed", "chunked": True,
          "body": "{B64:GET /smuggled HTTP/1.1\r\nHost: other.test\r\n\r\n}"},
         ("response", 200, None), {"decision": "allow"},
         check=_upstream_exactly("POST", "/ok/framed",
                                 b"GET /smuggled HTTP/1.1\r\nHost: other.test\r\n\r\n")),
    Case("HTTP/1 trailers through mitmproxy",  # mitmproxy cannot relay HTTP/1 trailers
         {"host": "unbound.test", "method": "POST", "target": "/t", "body": "{B64:hello}",
          "chunked": True, "trailers": [["X-Trailer", "clean"]]},
         ("closed", None, None), {**DENY, "error": "unsupported"}, engines=("mitmproxy",),
         check=_no_upstream_body),
    Case("F8 token without its header", {"host": "unbound.test",
                                         "headers": [["X-Steal", "{PAYLOAD}"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    Case("F8 token split over two headers",
         {"host": "unbound.test", "headers": [["X-A", "{TOKEN_A}"], ["X-B", "{TOKEN_B}"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    Case("F8 token in a gzip body",
         {"host": "unbound.test", "method": "POST", "target": "/gz", "body": "{GZ:{TOKEN}}",
          "headers": [["Content-Encoding", "gzip"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    # zstd (RFC 8878): refused unread as a coding the gateway could not undo, until the
    # twenty-first session; now decoded, bounded, as gzip is.
    Case("F8 token in a zstd body",
         {"host": "unbound.test", "method": "POST", "target": "/zst", "body": "{ZST:{TOKEN}}",
          "headers": [["Content-Encoding", "zstd"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    Case("F8 token in a zstd-compressed .env sent in a JSON string",
         {"host": "unbound.test", "method": "PUT", "target": "/repos/o/r/contents/.env.zst",
          "body": "{JSONZST:GATEWAY_TOKEN={TOKEN}\n}",
          "headers": [["Content-Type", "application/json"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    # A zstd file as pzstd writes it (a skippable frame first): neither check took it
    # for one until the twenty-second session; the token passed.
    Case("F8 token in a zstd .env with a skippable frame first, sent in a JSON string",
         {"host": "unbound.test", "method": "PUT", "target": "/repos/o/r/contents/.env.zst",
          "body": "{JSONSKIPZST:GATEWAY_TOKEN={TOKEN}\n}",
          "headers": [["Content-Type", "application/json"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    Case("F8 token in an uploaded pzstd-compressed file",
         {"host": "unbound.test", "method": "PUT", "target": "/bucket/env.zst",
          "body": "{PZST:GATEWAY_TOKEN={TOKEN}\n}",
          "headers": [["Content-Type", "application/octet-stream"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    Case("F8 token in a zstd .env with a skippable frame first in JSON, streamed",
         {"host": "unbound.test", "method": "PUT", "target": "/repos/o/r/contents/.env.zst",
          "chunked": True, "body": "{JSONSKIPZST2M:GATEWAY_TOKEN={TOKEN}\n}",
          "headers": [["Content-Type", "application/json"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         streamed=True, check=_no_upstream_body),
    # A gRPC message compressed by its call's grpc-encoding (no Content-Encoding says
    # so): the body's bytes never hold the token (it passed).
    Case("F8 token in a compressed gRPC message",
         {"host": "unbound.test", "method": "POST", "target": "/svc/Put",
          "body": "{GRPCGZ:{TOKEN}}",
          "headers": [["Content-Type", "application/grpc"], ["grpc-encoding", "gzip"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    Case("F8 token in a compressed gRPC-Web message in its text form",
         {"host": "unbound.test", "method": "POST", "target": "/svc/Put",
          "body": "{GRPCTEXT:{TOKEN}}",
          "headers": [["Content-Type", "application/grpc-web-text"],
                      ["grpc-encoding", "gzip"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    Case("F8 token committed to a file in a git push",
         {"host": "unbound.test", "method": "POST", "target": "/repo.git/git-receive-pack",
          "body": "{GITPUSH:GATEWAY_TOKEN={TOKEN}\n}",
          "headers": [["Content-Type", "application/x-git-receive-pack-request"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    # An archive a sandbox uploads (its workspace, to an object store) holds its files
    # deflated; whoever downloads it unpacks them.
    Case("F8 token committed to a file in a git push typed as something else",
         {"host": "unbound.test", "method": "POST", "target": "/repo.git/git-receive-pack",
          "body": "{GITPUSH:GATEWAY_TOKEN={TOKEN}\n}",
          "headers": [["Content-Type", "application/octet-stream"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    Case("F8 token in a .env of an uploaded .tar.gz",
         {"host": "unbound.test", "method": "PUT", "target": "/bucket/ws.tar.gz",
          "body": "{TGZ:GATEWAY_TOKEN={TOKEN}\n}",
          "headers": [["Content-Type", "application/gzip"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    # A file in a JSON string (GitHub's contents API): gzipped, or in base64 lines.
    Case("F8 token in a gzipped file sent in a JSON string",
         {"host": "unbound.test", "method": "PUT", "target": "/repos/o/r/contents/.env.gz",
          "body": "{JSONGZ:GATEWAY_TOKEN={TOKEN}\n}",
          "headers": [["Content-Type", "application/json"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    Case("F8 token in base64 lines of a file sent in a JSON string",
         {"host": "unbound.test", "method": "PUT", "target": "/repos/o/r/contents/.env",
          "body": "{JSONLINES:GATEWAY_TOKEN={TOKEN}\n}",
          "headers": [["Content-Type", "application/json"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    Case("F8 token at the end of a 2 MiB gzipped file in a JSON string, streamed",
         {"host": "unbound.test", "method": "PUT", "target": "/repos/o/r/contents/log.gz",
          "chunked": True, "body": "{JSONBIGGZ:GATEWAY_TOKEN={TOKEN}\n}",
          "headers": [["Content-Type", "application/json"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         streamed=True, check=_no_upstream_body),
    Case("F8 token in a .env of a zip an upload form sends",
         {"host": "unbound.test", "method": "POST", "target": "/bucket",
          "body": "{FORMZIP:GATEWAY_TOKEN={TOKEN}\n}",
          "headers": [["Content-Type", "multipart/form-data; boundary=b"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    Case("F8 token in a .env of a zip a streamed upload form sends",
         {"host": "unbound.test", "method": "POST", "target": "/bucket", "chunked": True,
          "body": "{FORMZIP3M:GATEWAY_TOKEN={TOKEN}\n}",
          "headers": [["Content-Type", "multipart/form-data; boundary=b"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         streamed=True, check=_no_upstream_body),
    # An image that is also a zip: unzip and zipfile extract what follows other bytes
    # (a self-extracting archive's layout); read from its first byte alone, before the
    # twenty-fourth session, the gateway saw no zip in it.
    Case("F8 token in a .env of a zip after an image's bytes",
         {"host": "unbound.test", "method": "PUT", "target": "/bucket/cat.png",
          "body": "{PNGZIP:GATEWAY_TOKEN={TOKEN}\n}",
          "headers": [["Content-Type", "image/png"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    Case("F8 token in a .env of a zip after an image's bytes, streamed",
         {"host": "unbound.test", "method": "PUT", "target": "/bucket/cat.png",
          "chunked": True, "body": "{PNGZIP3M:GATEWAY_TOKEN={TOKEN}\n}",
          "headers": [["Content-Type", "image/png"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         streamed=True, check=_no_upstream_body),
    Case("F8 token in an image that is also a zip, sent in a JSON string",
         {"host": "unbound.test", "method": "PUT", "target": "/repos/o/r/contents/cat.png",
          "body": "{JSONPNGZIP1:GATEWAY_TOKEN={TOKEN}\n}",
          "headers": [["Content-Type", "application/json"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    Case("F8 token in an image that is also a zip, sent in a JSON string, streamed",
         {"host": "unbound.test", "method": "PUT", "target": "/repos/o/r/contents/cat.png",
          "chunked": True, "body": "{JSONPNGZIP2M:GATEWAY_TOKEN={TOKEN}\n}",
          "headers": [["Content-Type", "application/json"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         streamed=True, check=_no_upstream_body),
    Case("F8 token in a .env of a zip after an image's bytes, a WebSocket message",
         {"host": "unbound.test", "target": "/ws", "headers": WS_UPGRADE,
          "ws": ["{WSBIN:{PNGZIP:GATEWAY_TOKEN={TOKEN}\n}}"]},
         ("ws-closed", 101, None), {**DENY, "error": "exfiltration_blocked"},
         engines=("h1", "mitmproxy"), check=_no_ws_message),
    # (the leak guard read a WebSocket message's bytes only, never its files, until the
    # twenty-fourth session: a gzip message carried the token past it; detection read it)
    Case("F8 token in a gzip WebSocket message",
         {"host": "unbound.test", "target": "/ws", "headers": WS_UPGRADE,
          "ws": ["{WSBIN:{GZ:GATEWAY_TOKEN={TOKEN}\n}}"]},
         ("ws-closed", 101, None), {**DENY, "error": "exfiltration_blocked"},
         engines=("h1", "mitmproxy"), check=_no_ws_message),
    Case("a body typed as gRPC-Web's binary and text forms both is refused unread",
         {"host": "unbound.test", "method": "POST", "target": "/svc/Put",
          "body": "{GRPCTEXT:hello}",
          "headers": [["Content-Type", "application/grpc-web"],
                      ["Content-Type", "application/grpc-web-text"]]},
         ("response", 400, "bad_request"), {**DENY, "error": "bad_request"},
         check=_no_upstream),
    Case("F8 token in a compressed gRPC message, gRPC the second Content-Type",
         {"host": "unbound.test", "method": "POST", "target": "/svc/Put",
          "body": "{GRPCGZ:{TOKEN}}",
          "headers": [["Content-Type", "application/octet-stream"],
                      ["Content-Type", "application/grpc"], ["grpc-encoding", "gzip"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    # A gzip body may be members one after another (RFC 1952 2.2), which Python's and
    # Go's readers decode; zlib stopped at the first, and the second was never read.
    Case("F8 token in the second member of a gzip body",
         {"host": "unbound.test", "method": "POST", "target": "/gz", "body": "{GZM:{TOKEN}}",
          "headers": [["Content-Encoding", "gzip"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    # Content-Encoding is a list: its field lines are one list (RFC 9110, 5.3), and a
    # receiver undoes every coding named; the gateway read the first line only.
    Case("F8 token in a gzip body its second Content-Encoding field names",
         {"host": "unbound.test", "method": "POST", "target": "/gz", "body": "{GZ:{TOKEN}}",
          "headers": [["Content-Encoding", "identity"], ["Content-Encoding", "gzip"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    # UTF-16 text (a receiver reads it by its charset or its byte-order mark): a NUL
    # between the token's characters, no run and no marker as sent (it passed).
    Case("F8 token in a UTF-16 body",
         {"host": "unbound.test", "method": "POST", "target": "/t",
          "body": "{U16LE:note: {TOKEN}}",
          "headers": [["Content-Type", "text/plain; charset=utf-16le"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    Case("F8 token swapped case", {"host": "unbound.test",
                                   "headers": [["X-Steal", "{TOKEN_SWAPCASE}"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         check=_no_upstream),
    Case("key to an unbound host", {"host": "unbound.test", "headers": [["X-K", "{KEY}"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         prime=SWAP, check=_no_upstream),
    Case(MINT, {"host": "minted.test", "target": "/echo-header/Authorization",
                "headers": [["Authorization", "Bearer {TOKEN}"]]},
         ("response", 200, None),
         {"decision": "allow", "credential": "minted", "status": 200}, check=_minted_swapped),
    Case("minted token to an unbound host",
         {"host": "unbound.test", "headers": [["X-K", "{MINTED}"]]},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         prime=MINT, check=_no_upstream),
    Case("mint failure", {"host": "mintfail.test", "target": "/v1/x",
                          "headers": [["Authorization", "Bearer {TOKEN}"]]},
         ("response", 503, "credential_unavailable"),
         {"error": "credential_unavailable", "credential": "mintfail"}, check=_only_the_mint),
    Case("minted credential over cleartext",
         {"host": "minted.test", "port": 80, "tls": False, "plain_proxy": True,
          "target": "http://minted.test/v1/x", "headers": [["Authorization", "Bearer {TOKEN}"]]},
         ("response", 403, "credential_requires_tls"),
         {**DENY, "error": "credential_requires_tls", "scheme": "http"},
         engines=("h1", "mitmproxy"), check=_no_upstream),
    Case("MCP: a tool the rule allows",
         {"host": "unbound.test", "method": "POST", "target": "/mcp/answer/json",
          "headers": [["Content-Type", "application/json"]],
          "body": "{B64:{\"jsonrpc\": \"2.0\", \"id\": 1, \"method\": \"tools/call\", "
                  "\"params\": {\"name\": \"search_issues\", \"arguments\": {}}}}"},
         ("response", 200, None), {"decision": "allow", "error": None}),
    Case("MCP: a tool the rule denies",
         {"host": "unbound.test", "method": "POST", "target": "/mcp",
          "headers": [["Content-Type", "application/json"], STREAMABLE],
          "body": "{B64:{\"jsonrpc\": \"2.0\", \"id\": 1, \"method\": \"tools/call\", "
                  "\"params\": {\"name\": \"delete_repo\", \"arguments\": {}}}}"},
         ("response", 200, "mcp_denied"), {**DENY, "error": "mcp_denied", "status": 200},
         check=_no_upstream),
    # The older HTTP+SSE transport (a POST that does not accept an event stream): the
    # refused call goes on as a ping, and its answer becomes the refusal.
    Case("MCP: a refused call of the older SSE transport goes as a ping",
         {"host": "unbound.test", "method": "POST", "target": "/mcp",
          "headers": [["Content-Type", "application/json"]],
          "body": "{B64:{\"jsonrpc\": \"2.0\", \"id\": 1, \"method\": \"tools/call\", "
                  "\"params\": {\"name\": \"delete_repo\", \"arguments\": {}}}}"},
         ("response", 200, None), {**DENY, "error": "mcp_denied", "status": 200},
         check=_relayed_ping),
    # mcp.pin_descriptions: the tool is pinned at its first listing (the state store's
    # pins); a listing of another description leaves it out, and its calls are refused.
    Case(PINNED, {"host": "unbound.test", "method": "POST", "target": "/pinned/mcp?d=one",
                  "headers": [["Content-Type", "application/json"], STREAMABLE],
                  "body": "{B64:" + LIST_TOOLS + "}"},
         ("response", 200, None), {"decision": "allow", "error": None}),
    Case(CHANGED, {"host": "unbound.test", "method": "POST", "target": "/pinned/mcp?d=two",
                   "headers": [["Content-Type", "application/json"], STREAMABLE],
                   "body": "{B64:" + LIST_TOOLS + "}"},
         ("response", 200, None), {"decision": "allow", "error": None}, prime=PINNED,
         check=_no_tools_listed),
    Case("MCP: a call of a pinned tool whose description changed is refused",
         {"host": "unbound.test", "method": "POST", "target": "/pinned/mcp",
          "headers": [["Content-Type", "application/json"], STREAMABLE],
          "body": "{B64:{\"jsonrpc\": \"2.0\", \"id\": 1, \"method\": \"tools/call\", "
                  "\"params\": {\"name\": \"search_issues\", \"arguments\": {}}}}"},
         ("response", 200, "mcp_tool_changed"),
         {**DENY, "error": "mcp_tool_changed", "status": 200}, prime=CHANGED,
         check=_no_upstream),
    Case("MCP: not JSON-RPC on an mcp rule",
         {"host": "unbound.test", "method": "POST", "target": "/mcp",
          "headers": [["Content-Type", "application/json"]], "body": "{B64:[1, 2]}"},
         ("response", 403, "mcp_denied"), {**DENY, "error": "mcp_denied"}, check=_no_upstream),
    # A chunked body: the HTTP/1 engine holds it (within the hold limit) and decides it
    # whole; mitmproxy cannot hold a body of unknown size, so it is refused, never passed.
    Case("MCP: a chunked call is decided whole",
         {"host": "unbound.test", "method": "POST", "target": "/mcp/answer/json",
          "chunked": True,
          "headers": [["Content-Type", "application/json"]],
          "body": "{B64:{\"jsonrpc\": \"2.0\", \"id\": 1, \"method\": \"ping\"}}"},
         ("response", 200, None), {"decision": "allow", "error": None}, engines=("h1",)),
    Case("MCP: a chunked call mitmproxy cannot hold is refused",
         {"host": "unbound.test", "method": "POST", "target": "/mcp", "chunked": True,
          "headers": [["Content-Type", "application/json"]],
          "body": "{B64:{\"jsonrpc\": \"2.0\", \"id\": 1, \"method\": \"ping\"}}"},
         ("response", 403, "mcp_denied"), {**DENY, "error": "mcp_denied"},
         engines=("mitmproxy", "h2"), check=_no_upstream),
    Case("model outside the allowlist (body)",
         {"host": "api.openai.com", "method": "POST", "target": "/v1/chat/completions",
          "headers": [["Authorization", "Bearer {TOKEN}"], ["Content-Type", "application/json"]],
          "body": "{B64:{\"model\": \"gpt-4o\", \"messages\": []}}"},
         ("response", 403, "model_not_allowed"),
         {**DENY, "error": "model_not_allowed", "credential": None}, check=_no_upstream),
    Case("a fallback model outside the allowlist (OpenRouter's models list)",
         {"host": "api.openai.com", "method": "POST", "target": "/v1/chat/completions",
          "headers": [["Authorization", "Bearer {TOKEN}"], ["Content-Type", "application/json"]],
          "body": "{B64:{\"model\": \"gpt-4o-mini\", \"models\": [\"gpt-4o-mini\", "
                  "\"gpt-4o\"], \"route\": \"fallback\", \"messages\": []}}"},
         ("response", 403, "model_not_allowed"),
         {**DENY, "error": "model_not_allowed", "credential": None}, check=_no_upstream),
    Case("model outside the allowlist (Realtime query)",
         {"host": "api.openai.com", "target": "/v1/realtime?model=gpt-4o-realtime",
          "headers": [["Authorization", "Bearer {TOKEN}"], ["Upgrade", "websocket"],
                      ["Connection", "Upgrade"], ["Sec-WebSocket-Version", "13"],
                      ["Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="]]},
         ("response", 403, "model_not_allowed"),
         {**DENY, "error": "model_not_allowed", "path": "/v1/realtime"},
         engines=("h1", "mitmproxy"), check=_no_upstream),
    Case("a Realtime session is metered (its server events)",
         {"host": "api.openai.com", "target": "/v1/realtime?model=gpt-4o-mini-realtime",
          "headers": [["Authorization", "Bearer {TOKEN}"], *WS_UPGRADE],
          "ws": [REALTIME_DONE]},  # (echoed back: a server event the gateway reads)
         ("ws-echo", 101, None),
         {"decision": "allow", "credential": "openai", "path": "/v1/realtime",
          "usage": {"model": "gpt-4o-mini-realtime", "input_tokens": 7, "output_tokens": 3,
                    "cached_input_tokens": 2, "cost_usd": None}},
         engines=("h1", "mitmproxy")),
    Case(BUDGETED, {"host": "budget.test", "method": "POST", "target": "/v1/chat/completions",
                    "headers": [["Authorization", "Bearer {TOKEN}"]],
                    "body": "{B64:{\"model\": \"m\", \"messages\": []}}"},
         ("response", 200, None), {"decision": "allow", "credential": "budgeted"}),
    Case("budget used up", {"host": "budget.test", "method": "POST",
                            "target": "/v1/chat/completions",
                            "headers": [["Authorization", "Bearer {TOKEN}"]],
                            "body": "{B64:{\"model\": \"m\", \"messages\": []}}"},
         ("response", 429, "budget_exceeded"), {**DENY, "error": "budget_exceeded"},
         prime=BUDGETED, check=_no_upstream),
    Case("2 MiB body on a models rule",
         {"host": "api.openai.com", "method": "POST", "target": "/v1/chat/completions",
          "headers": [["Authorization", "Bearer {TOKEN}"], ["Content-Type", "application/json"]],
          "body": "{B64:{\"model\": \"gpt-4o-mini\", \"messages\": [], \"pad\": \"{PAD}\"}}"},
         ("response", 200, None), {"decision": "allow", "credential": "openai"},
         check=_whole_body(len(PAD), "gpt-4o-mini")),
    Case("2 MiB body naming a model outside the allowlist",
         {"host": "api.openai.com", "method": "POST", "target": "/v1/chat/completions",
          "headers": [["Authorization", "Bearer {TOKEN}"], ["Content-Type", "application/json"]],
          "body": "{B64:{\"pad\": \"{PAD}\", \"model\": \"gpt-4o\", \"messages\": []}}"},
         ("response", 403, "model_not_allowed"), {**DENY, "error": "model_not_allowed"},
         check=_no_upstream),
    Case("2 MiB body on a SigV4 credential",
         {"host": "sigv4.test", "method": "POST", "target": "/model/m/converse",
          "headers": [["x-amz-security-token", "{TOKEN}"],
                      ["x-amz-content-sha256", "0" * 64],
                      ["Content-Type", "application/json"]],
          "body": "{B64:{\"model\": \"m\", \"pad\": \"{PAD}\"}}"},
         ("response", 200, None), {"decision": "allow", "credential": "sigv4"},
         check=_signed_over_the_body),
    Case("a gzip body's model is checked",
         {"host": "api.openai.com", "method": "POST", "target": "/v1/chat/completions",
          "headers": [["Authorization", "Bearer {TOKEN}"], ["Content-Encoding", "gzip"],
                      ["Content-Type", "application/json"]],
          "body": "{GZ:{\"model\": \"gpt-4o\", \"messages\": []}}"},
         ("response", 403, "model_not_allowed"), {**DENY, "error": "model_not_allowed"},
         check=_no_upstream),
    Case("a gzip streamed call asks for its usage",
         {"host": "api.openai.com", "method": "POST", "target": "/v1/chat/completions",
          "headers": [["Authorization", "Bearer {TOKEN}"], ["Content-Encoding", "gzip"],
                      ["Content-Type", "application/json"]],
          "body": "{GZ:{\"model\": \"gpt-4o-mini\", \"messages\": [], \"stream\": true}}"},
         ("response", 200, None), {"decision": "allow", "credential": "openai"},
         check=_usage_asked),
    Case("another spelling of the endpoint asks for usage",
         {"host": "api.openai.com", "method": "POST", "target": "//v1/chat/completion%73/",
          "headers": [["Authorization", "Bearer {TOKEN}"], ["Content-Type", "application/json"]],
          "body": "{B64:{\"model\": \"gpt-4o-mini\", \"messages\": [], \"stream\": true}}"},
         ("response", 200, None), {"decision": "allow", "credential": "openai"},
         check=_usage_asked),
    Case("a chunked body's model is checked",
         {"host": "api.openai.com", "method": "POST", "target": "/v1/chat/completions",
          "headers": [["Authorization", "Bearer {TOKEN}"], ["Content-Type", "application/json"]],
          "chunked": True, "body": "{B64:{\"model\": \"gpt-4o\", \"messages\": []}}"},
         ("response", 403, "model_not_allowed"), {**DENY, "error": "model_not_allowed"},
         engines=("h1", "mitmproxy"), check=_no_upstream_body),
    Case("case-variant keys are refused like repeated ones",
         {"host": "api.openai.com", "method": "POST", "target": "/v1/chat/completions",
          "headers": [["Authorization", "Bearer {TOKEN}"], ["Content-Type", "application/json"]],
          "body": "{B64:{\"model\": \"gpt-4o-mini\", \"Model\": \"gpt-4o\"}}"},
         ("response", 403, "model_not_allowed"), {**DENY, "error": "model_not_allowed"},
         check=_no_upstream),
    Case("a provider-minted secret is refused by default",
         {"host": "api.openai.com", "method": "POST", "target": "/v1/realtime/client_secrets",
          "headers": [["Authorization", "Bearer {TOKEN}"], ["Content-Type", "application/json"]],
          "body": "{B64:{\"session\": {\"type\": \"realtime\", "
                  "\"model\": \"gpt-4o-mini-realtime\"}}}"},
         ("response", 403, "minted_secret_refused"),
         {**DENY, "error": "minted_secret_refused"}, check=_no_upstream),
    Case("a call that cannot be metered on a metered rule",
         {"host": "metered.test", "method": "POST", "target": "/v1/images/generations",
          "headers": [["Authorization", "Bearer {TOKEN}"], ["Content-Type", "application/json"]],
          "body": "{B64:{\"prompt\": \"a cat\"}}"},
         ("response", 403, "metering_unavailable"),
         {**DENY, "error": "metering_unavailable"}, check=_no_upstream),
    Case("a Responses WebSocket event for another model",
         {"host": "api.openai.com", "target": "/v1/responses",
          "headers": [["Authorization", "Bearer {TOKEN}"], *WS_UPGRADE],
          "ws": ["{\"type\": \"response.create\", \"model\": \"gpt-4o\"}"]},
         ("ws-echo", 101, None), {**DENY, "error": "model_not_allowed", "path": "/v1/responses"},
         engines=("h1", "mitmproxy"), check=_error_event("model_not_allowed"), lines=2),
    Case("key in the query to an unbound host",
         {"host": "unbound.test", "target": "/q?k={KEY}"},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         prime=SWAP, check=_no_upstream),
    Case("key in a body to an unbound host",
         {"host": "unbound.test", "method": "POST", "target": "/b",
          "body": "{B64:{\"k\": \"{KEY}\"}}"},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         prime=SWAP, check=_no_upstream),
    Case("key in a WebSocket message to an unbound host",
         {"host": "unbound.test", "target": "/ws", "headers": WS_UPGRADE, "ws": ["{KEY}"]},
         ("ws-closed", 101, None), {**DENY, "error": "exfiltration_blocked"},
         engines=("h1", "mitmproxy"), prime=SWAP, check=_no_ws_message),
    Case("F7 key echoed in a gzip body",
         {"host": "api.openai.com", "target": "/echo-gzip/Authorization",
          "headers": [["Authorization", "Bearer {TOKEN}"], ["Accept-Encoding", "gzip"]]},
         ("response", 200, None), {"decision": "allow", "credential": "openai"},
         check=_no_key),
    # (refused `upstream_failed` as a coding the gateway could not undo until the
    # twenty-first session; decoded now, and redacted)
    Case("F7 key echoed in a zstd body",
         {"host": "api.openai.com", "target": "/echo-zstd/Authorization",
          "headers": [["Authorization", "Bearer {TOKEN}"], ["Accept-Encoding", "zstd"]]},
         ("response", 200, None), {"decision": "allow", "credential": "openai"},
         check=_no_key),
    Case("F7 key echoed in the second member of a gzip answer",
         {"host": "api.openai.com", "target": "/echo-gzip-members/Authorization",
          "headers": [["Authorization", "Bearer {TOKEN}"], ["Accept-Encoding", "gzip"]]},
         ("response", 200, None), {"decision": "allow", "credential": "openai"},
         check=_both_members),
    Case("F7 key echoed in a gzip body its second Content-Encoding field names",
         {"host": "api.openai.com", "target": "/echo-gzip-split/Authorization",
          "headers": [["Authorization", "Bearer {TOKEN}"], ["Accept-Encoding", "gzip"]]},
         ("response", 200, None), {"decision": "allow", "credential": "openai"},
         check=_no_key_gunzipped),
    Case("F7 key echoed as UTF-16 text",
         {"host": "api.openai.com", "target": "/echo-utf16/Authorization",
          "headers": [["Authorization", "Bearer {TOKEN}"]]},
         ("response", 200, None), {"decision": "allow", "credential": "openai"},
         check=_no_key_wide),
    Case("F3 key echoed in the status line",
         {"host": "api.openai.com", "target": "/echo-reason/Authorization",
          "headers": [["Authorization", "Bearer {TOKEN}"]]},
         ("response", 200, None), {"decision": "allow", "credential": "openai"},
         engines=("h1", "mitmproxy"), check=_no_key),
    Case("F3 key echoed in a malformed answer",
         {"host": "api.openai.com", "target": "/echo-te/Authorization",
          "headers": [["Authorization", "Bearer {TOKEN}"]]},
         ("response", 502, "upstream_failed"), {"error": "upstream_failed"}, check=_no_key),
    Case("F1 a key never goes over cleartext",
         {"host": "api.openai.com", "port": 80, "tls": False, "plain_proxy": True,
          "target": "http://api.openai.com/v1/models",
          "headers": [["Authorization", "Bearer {TOKEN}"]]},
         ("response", 403, "credential_requires_tls"),
         {**DENY, "error": "credential_requires_tls", "scheme": "http"},
         engines=("h1", "mitmproxy"), check=_no_upstream),
    Case("forbidden destination", {"host": "169.254.169.254"},
         ("connect", 403, "forbidden_destination"),
         {**CONNECT_DENY, "error": "forbidden_destination", "host": "169.254.169.254"},
         transparent=("tls", None, None), check=_no_upstream),
    Case("unresolvable", {"host": "noname.test"}, ("connect", 502, "unresolvable"),
         {**CONNECT_DENY, "error": "unresolvable"}, transparent=("skip", None, None)),
    Case("expired token", {"host": "other.test"}, ("connect", 407, "token_expired"),
         {**CONNECT_DENY, "error": "token_expired", **NAMED}, token="expired",
         transparent=("skip", None, None)),
    Case("revoked token", {"host": "other.test"}, ("connect", 407, "token_revoked"),
         {**CONNECT_DENY, "error": "token_revoked", **NAMED}, token="revoked",
         transparent=("skip", None, None)),
    Case("F12 lower-case method", {"host": "other.test", "method": "get", "target": "/ok/a"},
         ("response", 400, "bad_request"), {**DENY, "error": "bad_request"},
         engines=("h1", "mitmproxy"), check=_no_upstream),
    Case("F12 NUL in a header value", {"host": "other.test", "target": "/ok/a",
                                       "headers": [["X-N", "a\x00b"]]},
         ("response", 400, "bad_request"), {**DENY, "error": "bad_request"},
         engines=("h1", "mitmproxy"), check=_no_upstream),
    Case("F12 upgrade to h2c", {"host": "other.test", "target": "/ok/a",
                                "headers": [["Upgrade", "h2c"], ["Connection", "Upgrade"]]},
         ("response", 501, "unsupported"), {**DENY, "error": "unsupported"},
         engines=("h1", "mitmproxy"), check=_no_upstream),
    *MCP_WIRE,
    *MCP_OAUTH,
    *LEARN_CASES,
]


def _no_fake(result: Result, seen: list[Any]) -> None:
    """The fake credential reached no upstream (nor a complete request with it)."""
    assert all(GH.encode() not in s.body and GH not in json.dumps(s.headers) for s in seen), \
        [s.path for s in seen]


def _no_escaped(result: Result, seen: list[Any]) -> None:
    """The escaped fake credential reached no upstream."""
    escaped = f"\\u{ord(GH[0]):04x}{GH[1:]}".encode()
    assert all(escaped not in s.body for s in seen), [s.path for s in seen]


def _no_percent(result: Result, seen: list[Any]) -> None:
    """The percent-encoded fake credential reached no upstream."""
    encoded = f"%{ord(GH[0]):02X}{GH[1:]}".encode()
    assert all(encoded not in s.body for s in seen), [s.path for s in seen]


def _upstream_got(what: str) -> Callable[[Result, list[Any]], None]:
    def check(result: Result, seen: list[Any]) -> None:
        assert len(seen) == 1 and what.encode() in seen[0].body, seen
    return check


def _redacted(result: Result, seen: list[Any]) -> None:
    """The upstream got the JSON body, the value replaced, still JSON."""
    assert len(seen) == 1 and GH.encode() not in seen[0].body, seen
    assert json.loads(seen[0].body) == {"note": "deploy with [REDACTED]"}


_DLP = {**DENY, "error": "secret_detected"}
_PROSE, _PROSE_END = "the model returns a value " * 80_660, "and ends " * 7_300  # (2 MiB)
_JSON = ["Content-Type", "application/json"]
_BROWSER = "----WebKitFormBoundary7MA4YWxkTrZu0gW"  # (a browser's: capitals)


def _dlp_post(target: str, body: str, *headers: list[str]) -> dict[str, Any]:
    return {"host": "other.test", "method": "POST", "target": target,
            "headers": list(headers), "body": body}


# Issue 43: a credential the gateway did not issue, on a rule with dlp:, on every engine.
DLP = [
    Case("DLP: a credential in a header", {"host": "other.test", "target": "/dlp/h",
                                           "headers": [["X-Deploy", "{GH}"]]},
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential in a JSON body",
         _dlp_post("/dlp/j", "{B64:{\"note\": \"deploy with {GH}\"}}", _JSON),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    # The JSON strings are read in C where it is sure json reads the same, else by json
    # (core/dlp/_jsontext.c): a document it declines (nested past 256) and one it reads
    # (the key's first character a \u escape, beside a surrogate pair) refuse alike.
    Case("DLP: a credential in a JSON body nested 300 deep",
         _dlp_post("/dlp/j", "{B64:" + "[" * 300 + "{\"note\": \"deploy with {GH}\"}"
                   + "]" * 300 + "}", _JSON),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential JSON-escaped beside a surrogate pair",
         _dlp_post("/dlp/j", "{B64:{\"e\": \"\\ud83d\\ude00\", "
                   "\"note\": \"deploy with {GH_ESCAPED}\"}}", _JSON),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    # Read as the receiver reads them: a name beside its value, a letter of it \u-escaped
    # (the rules reading a name, aws and gcp, read the raw text), and a JSON body streamed
    # past the hold limit, the credential's first letter escaped (the window read raw).
    Case("DLP: an AWS secret beside its name with a letter JSON-escaped",
         _dlp_post("/dlp/j", "{B64:{\"\\u0061ws_secret_access_key\": \"{AWS_SECRET}\"}}",
                   _JSON),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential JSON-escaped in a streamed JSON body",
         {**_dlp_post("/dlp/s", "{B64:{\"pad\": \"{PAD_2M}\", \"note\": \"deploy with "
                      "{GH_ESCAPED}\"}}", _JSON), "chunked": True},
         ("response", 403, "secret_detected"), _DLP, streamed=True, check=_no_escaped),
    Case("DLP: a credential percent-encoded in a streamed form body",
         {**_dlp_post("/dlp/s", "{B64:pad={PAD_2M}&note={GH_PERCENT}}",
                      ["Content-Type", "application/x-www-form-urlencoded"]),
          "chunked": True},
         ("response", 403, "secret_detected"), _DLP, streamed=True, check=_no_percent),
    # A text the scan would read for minutes (each match of an anchor repeated with no END
    # reading to the window's end): refused as unread, at once, on every engine.
    Case("DLP: a body of one anchor over and over is refused unread",
         _dlp_post("/dlp/t", "{B64:{PEM_FLOOD}}", ["Content-Type", "text/plain"]),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    # A text made for one detector's expression (npm's `//.+/:_authToken=…`, quadratic on
    # `//` and anchors: 208 KB cost ~20 s of the event loop): refused within its bound.
    Case("DLP: a body made for a detector's expression is refused within its bound",
         _dlp_post("/dlp/t", "{B64:{NPM_FLOOD}}", ["Content-Type", "text/plain"]),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    # The opt-in IBM detectors' shipped patterns read a name and n spaces in n³ steps
    # (2 KB: 50 s, the GIL held): written linear (services/dlp/library.py), a name and
    # 64 KiB of spaces passes at once, and their credentials are still found.
    Case("DLP: a name and 64 KiB of spaces is read at once by the opt-in IBM detectors",
         _dlp_post("/dlp-ibm/t", "{B64:clpw{SPACES}}", ["Content-Type", "text/plain"]),
         ("response", 200, None), {"decision": "allow", "error": None},
         check=_upstream_exactly("POST", "/dlp-ibm/t", b"clpw" + b" " * 65536)),
    Case("DLP: an opt-in IBM detector's credential after a run of spaces",
         _dlp_post("/dlp-ibm/t", "{B64:cloudant_password{SPACES_1K}= {CLOUDANT}}",
                   ["Content-Type", "text/plain"]),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    # A charset that names no byte order, and no byte-order mark: Python reads it
    # little-endian, RFC 2781 big-endian, a receiver either; a key in one order is noise
    # in the other, so the body is refused as unreadable (it was read little-endian and
    # the big-endian key passed).
    Case("DLP: a credential in UTF-16 big-endian, its charset naming no byte order",
         _dlp_post("/dlp/t", "{U16BE:note: deploy with {GH}}",
                   ["Content-Type", "text/plain; charset=utf-16"]),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    # A chunked body's first chunk of one byte: its reading is chosen once four bytes are
    # in (a JSON reader finds UTF-16 by its NULs); before, the one byte made the rest read
    # as latin-1, and the key passed.
    Case("DLP: a credential in a streamed UTF-16 JSON body whose first chunk is a byte",
         {**_dlp_post("/dlp/s", "{U16LE:{\"pad\": \"{PAD_2M}\", \"note\": \"deploy with "
                      "{GH}\"}}", _JSON), "chunked": True, "first_chunk": 1},
         ("response", 403, "secret_detected"), _DLP, streamed=True, check=_no_fake),
    # Two Content-Types: a receiver reads the body by either (the first, the last), and
    # the key below is seen only by a JSON reader, so the request is refused unread (it
    # was read as the first, a form, and passed).
    Case("DLP: a request naming two Content-Types is refused unread",
         _dlp_post("/dlp/j", "{B64:{\"note\": \"deploy with {GH_ESCAPED}\"}}",
                   ["Content-Type", "application/x-www-form-urlencoded"], _JSON),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    # A JSON document sent as a form, or as multipart with no part: a receiver that reads
    # JSON whatever the type says (Go's json.NewDecoder, `request.json()`) undoes its
    # escapes; it was read as a form, or as text, and the key passed.
    Case("DLP: a credential JSON-escaped in a JSON document sent as a form",
         _dlp_post("/dlp/j", "{B64:{\"note\": \"deploy with {GH_ESCAPED}\"}}",
                   ["Content-Type", "application/x-www-form-urlencoded"]),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential JSON-escaped in a JSON document sent as multipart",
         _dlp_post("/dlp/m", "{B64:{\"note\": \"deploy with {GH_ESCAPED}\"}}",
                   ["Content-Type", "multipart/form-data; boundary=b"]),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential JSON-escaped in a streamed JSON document sent as a form",
         {**_dlp_post("/dlp/s", "{B64:{\"pad\": \"{PAD_2M}\", \"note\": \"deploy with "
                      "{GH_ESCAPED}\"}}", ["Content-Type", "application/x-www-form-urlencoded"]),
          "chunked": True},
         ("response", 403, "secret_detected"), _DLP, streamed=True, check=_no_escaped),
    # A byte-order mark first (a JSON reader of bytes skips it), or a byte a lenient JSON
    # reader reads past: read as text only before, and `\u0067hp_...` passed.
    Case("DLP: a credential JSON-escaped in a JSON document after a byte-order mark",
         _dlp_post("/dlp/j", "{B64:\ufeff{\"note\": \"deploy with {GH_ESCAPED}\"}}",
                   ["Content-Type", "text/plain"]),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential JSON-escaped in JSON after a stray character",
         _dlp_post("/dlp/j", "{B64:\u00a0{\"note\": \"deploy with {GH_ESCAPED}\"}}", _JSON),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    # JSON in a JSON string (a tool call's `arguments`), in a header's value: the reader
    # parsing it undoes its escapes; read as text only, `\u0067hp_...` passed.
    Case("DLP: a credential JSON-escaped in a tool call's arguments",
         _dlp_post("/dlp/j", "{B64:{\"messages\": [{\"role\": \"assistant\", "
                   "\"tool_calls\": [{\"id\": \"call_1\", \"function\": {\"name\": "
                   "\"write\", \"arguments\": \"{\\\"note\\\": \\\"{GH_ESCAPED_IN}"
                   "\\\"}\"}}]}]}}", _JSON),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential JSON-escaped in a header's JSON value",
         {**_dlp_post("/dlp/j", "{B64:{}}", _JSON),
          "headers": [["Content-Type", "application/json"],
                      ["X-Meta", "{\"note\": \"{GH_ESCAPED}\"}"]]},
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential in a trailer",
         {**_dlp_post("/dlp/s", "{B64:hello}"), "chunked": True,
          "trailers": [["X-Deploy", "deploy with {GH}"]]},
         ("response", 403, "secret_detected"), _DLP, streamed=True,
         check=_no_upstream_body, engines=("h1", "h2")),
    Case("DLP: a credential in a gzip body",
         _dlp_post("/dlp/gz", "{GZ:{\"note\": \"{GH}\"}}", _JSON,
                   ["Content-Encoding", "gzip"]),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential in a zstd-compressed .env sent in a JSON string",
         {**_dlp_post("/dlp/contents/.env.zst", "{JSONZST:GITHUB_TOKEN={GH}\n}", _JSON),
          "method": "PUT"},
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential in a pzstd-compressed .env sent in a JSON string",
         {**_dlp_post("/dlp/contents/.env.zst", "{JSONPZST:GITHUB_TOKEN={GH}\n}", _JSON),
          "method": "PUT"},
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential in a pzstd-compressed .env in a JSON string, streamed",
         {**_dlp_post("/dlp/s", "{JSONPZST2M:GITHUB_TOKEN={GH}\n}", _JSON), "chunked": True},
         ("response", 403, "secret_detected"), _DLP, streamed=True, check=_no_upstream_body),
    Case("DLP: a credential in an uploaded pzstd-compressed file",
         _dlp_post("/dlp/up.zst", "{PZST:GITHUB_TOKEN={GH}\n}",
                   ["Content-Type", "application/octet-stream"]),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    # A coded body small as sent, 2 MiB decoded: the engines that stream it read it as
    # it decodes; HTTP/1, which held it, refused it unread until the twenty-first.
    Case("DLP: a gzip body that decodes past the hold limit reaches the upstream as sent",
         {**_dlp_post("/dlp/s", "{GZ:{PROSE}{PROSE_END}}", ["Content-Encoding", "gzip"]),
          "chunked": True},
         ("response", 200, None), {"decision": "allow", "error": None},
         check=lambda result, seen: _upstream_gunzips_to((_PROSE + _PROSE_END).encode(),
                                                         seen)),
    Case("DLP: a credential in a gzip body that decodes past the hold limit",
         {**_dlp_post("/dlp/s", "{GZ:{PROSE}{GH} {PROSE_END}}", ["Content-Encoding", "gzip"]),
          "chunked": True},
         ("response", 403, "secret_detected"), _DLP, streamed=True, check=_no_upstream_body),
    Case("DLP: a zstd-coded body reaches the upstream as sent",
         {**_dlp_post("/dlp/s", "{ZST:{\"note\": \"the build passed\"}}", _JSON,
                      ["Content-Encoding", "zstd"]), "chunked": True},
         ("response", 200, None), {"decision": "allow", "error": None},
         check=lambda result, seen: _upstream_exactly("POST", "/dlp/s", base64.b64decode(
             _zst('{"note": "the build passed"}')))(result, seen)),
    Case("DLP: a credential in a zstd-coded body",
         _dlp_post("/dlp/zst", "{ZST:{\"note\": \"{GH}\"}}", _JSON,
                   ["Content-Encoding", "zstd"]),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential in a compressed gRPC message",
         _dlp_post("/dlp/g", "{GRPCGZ:deploy with {GH}}", ["Content-Type", "application/grpc"],
                   ["grpc-encoding", "gzip"]),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential committed to a file in a git push",
         _dlp_post("/dlp/repo.git/git-receive-pack", "{GITPUSH:GITHUB_TOKEN={GH}\n}",
                   ["Content-Type", "application/x-git-receive-pack-request"]),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential committed to a file in a git push with no Content-Type",
         _dlp_post("/dlp/repo.git/git-receive-pack", "{GITPUSH:GITHUB_TOKEN={GH}\n}"),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential in a .env of an uploaded zip",
         {**_dlp_post("/dlp/ws.zip", "{ZIP:GITHUB_TOKEN={GH}\n}"), "method": "PUT"},
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential in a .env of a zip after an image's bytes",
         {**_dlp_post("/dlp/cat.png", "{PNGZIP:GITHUB_TOKEN={GH}\n}",
                      ["Content-Type", "image/png"]), "method": "PUT"},
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential in a .env of a zip after an image's bytes, streamed",
         {**_dlp_post("/dlp/s", "{PNGZIP3M:GITHUB_TOKEN={GH}\n}",
                      ["Content-Type", "image/png"]), "chunked": True},
         ("response", 403, "secret_detected"), _DLP, streamed=True, check=_no_upstream_body),
    Case("DLP: a credential in an image that is also a zip, sent in a JSON string",
         {**_dlp_post("/dlp/contents/cat.png", "{JSONPNGZIP2:GITHUB_TOKEN={GH}\n}", _JSON),
          "method": "PUT"},
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential in an image that is also a zip, sent in a JSON string, streamed",
         {**_dlp_post("/dlp/s", "{JSONPNGZIP1M:GITHUB_TOKEN={GH}\n}", _JSON),
          "chunked": True},
         ("response", 403, "secret_detected"), _DLP, streamed=True, check=_no_upstream_body),
    Case("DLP: a credential in a .env of a streamed .tar.gz upload",
         {**_dlp_post("/dlp/s", "{TGZ3M:GITHUB_TOKEN={GH}\n}"), "chunked": True},
         ("response", 403, "secret_detected"), _DLP, streamed=True, check=_no_upstream_body),
    Case("DLP: a credential in a .env of a zip a streamed upload form sends",
         {**_dlp_post("/dlp/s", "{FORMZIP3M:GITHUB_TOKEN={GH}\n}",
                      ["Content-Type", "multipart/form-data; boundary=b"]), "chunked": True},
         ("response", 403, "secret_detected"), _DLP, streamed=True, check=_no_upstream_body),
    Case("DLP: a credential in a gzipped file sent in a JSON string",
         {**_dlp_post("/dlp/contents/.env.gz", "{JSONGZ:GITHUB_TOKEN={GH}\n}", _JSON),
          "method": "PUT"},
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential in base64 lines of a file sent in a JSON string",
         {**_dlp_post("/dlp/contents/.env", "{JSONLINES:GITHUB_TOKEN={GH}\n}", _JSON),
          "method": "PUT"},
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential in a gzipped file in a JSON string, streamed",
         {**_dlp_post("/dlp/s", "{JSONGZ2M:GITHUB_TOKEN={GH}\n}", _JSON), "chunked": True},
         ("response", 403, "secret_detected"), _DLP, streamed=True, check=_no_upstream_body),
    Case("DLP: a credential in base64 lines of a file in a JSON string, streamed",
         {**_dlp_post("/dlp/s", "{JSONLINES2M:GITHUB_TOKEN={GH}\n}", _JSON),
          "chunked": True},
         ("response", 403, "secret_detected"), _DLP, streamed=True, check=_no_upstream_body),
    # A file of 2 MiB in a JSON string (a run of 1.6 MB): read as it streams, not
    # refused as unreadable (past 1 MiB before the twenty-first session).
    Case("DLP: a credential at the end of a 2 MiB gzipped file in a JSON string, streamed",
         {**_dlp_post("/dlp/s", "{JSONBIGGZ:GITHUB_TOKEN={GH}\n}", _JSON), "chunked": True},
         ("response", 403, "secret_detected"), _DLP, streamed=True, check=_no_upstream_body),
    Case("DLP: a 2 MiB gzipped file in a JSON string, streamed, reaches the upstream whole",
         {**_dlp_post("/dlp/s", "{JSONBIGGZ:LOG_LEVEL=debug\n}", _JSON), "chunked": True},
         ("response", 200, None), {"decision": "allow", "error": None},
         check=lambda result, seen: _upstream_exactly("POST", "/dlp/s", base64.b64decode(
             _json_file("LOG_LEVEL=debug\n", "gz", 0, 2 << 20)))(result, seen)),
    Case("DLP: a credential in a compressed gRPC-Web message in its text form",
         _dlp_post("/dlp/g", "{GRPCTEXT:deploy with {GH}}",
                   ["Content-Type", "application/grpc-web-text+proto"], ["grpc-encoding", "gzip"]),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential in the second member of a gzip body",
         _dlp_post("/dlp/gz", "{GZM:{\"note\": \"{GH}\"}}", _JSON,
                   ["Content-Encoding", "gzip"]),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    # (the leak guard reads it first: a body it cannot decode is a bad request)
    Case("a deflate body with bytes after its end is refused unread",
         _dlp_post("/dlp/gz", "{DEFLATE_TAIL:{\"note\": \"{GH}\"}}", _JSON,
                   ["Content-Encoding", "deflate"]),
         ("response", 400, "bad_request"), {**DENY, "error": "bad_request"},
         check=_no_upstream),
    Case("DLP: a credential in a gzip body its second Content-Encoding field names",
         _dlp_post("/dlp/gz", "{GZ:{\"note\": \"{GH}\"}}", _JSON,
                   ["Content-Encoding", "identity"], ["Content-Encoding", "gzip"]),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    # A browser's multipart boundary has capitals: the boundary was read from the
    # Content-Type lowercased, no part was found, and nothing of the body was read.
    Case("DLP: a credential in a multipart part behind a browser's boundary",
         _dlp_post("/dlp/m", "{B64:--" + _BROWSER + "\r\nContent-Disposition: form-data; "
                   "name=\"notes\"\r\n\r\ndeploy with {GH}\r\n--" + _BROWSER + "--\r\n}",
                   ["Content-Type", "multipart/form-data; boundary=" + _BROWSER]),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    # Streamed past the hold limit, a multipart body is read as text: a part coded in a
    # way a stream is not decoded from is refused (it passed unread).
    Case("DLP: a credential in a gzip part of a streamed multipart body",
         {**_dlp_post("/dlp/s", "{MPGZ:deploy with {GH}}",
                      ["Content-Type", "multipart/form-data; boundary=b"]), "chunked": True},
         ("response", 403, "secret_detected"), _DLP, streamed=True, check=_no_upstream_body),
    # A MIME transfer encoding a receiver undoes: `=67` is `g` (it passed unread).
    Case("DLP: a credential quoted-printable in a multipart part",
         _dlp_post("/dlp/m", "{B64:--b\r\nContent-Disposition: form-data; name=\"f\"\r\n"
                   "Content-Transfer-Encoding: quoted-printable\r\n\r\ndeploy with "
                   "{GH_QP}\r\n--b--\r\n}", ["Content-Type", "multipart/form-data; boundary=b"]),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    # Outside the parts: a receiver that stores the body as it came keeps a preamble.
    Case("DLP: a credential in a multipart body's preamble",
         _dlp_post("/dlp/m", "{B64:deploy with {GH}\r\n--b\r\nContent-Disposition: "
                   "form-data; name=\"x\"\r\n\r\nx\r\n--b--\r\n}",
                   ["Content-Type", "multipart/form-data; boundary=b"]),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential in a form",
         _dlp_post("/dlp/f", "{B64:user=a&token={GH}}",
                   ["Content-Type", "application/x-www-form-urlencoded"]),
         ("response", 403, "secret_detected"), _DLP, check=_no_upstream),
    Case("DLP: a credential split across the chunks of a streamed body",
         {**_dlp_post("/dlp/s", "{B64:{GH_PAD}}"), "chunked": True},
         ("response", 403, "secret_detected"), _DLP, streamed=True, check=_no_fake),
    # A streamed body of prose (no run, no anchor: each chunk's one gate pass, shared by
    # the leak guard and detection, says so) with a credential, or a gateway token, late.
    Case("DLP: a credential after 2 MiB of prose in a streamed body",
         {**_dlp_post("/dlp/s", "{B64:{PROSE}{GH} {PROSE_END}}"), "chunked": True},
         ("response", 403, "secret_detected"), _DLP, streamed=True, check=_no_fake),
    Case("DLP: a gateway token after 2 MiB of prose in a streamed body",
         {**_dlp_post("/dlp/s", "{B64:{PROSE}{TOKEN} {PROSE_END}}"), "chunked": True},
         ("response", 403, "exfiltration_blocked"), {**DENY, "error": "exfiltration_blocked"},
         streamed=True, check=_no_upstream_body),
    Case("DLP: a streamed body of prose reaches the upstream whole",
         {**_dlp_post("/dlp/s", "{B64:{PROSE}{PROSE_END}}"), "chunked": True},
         ("response", 200, None), {"decision": "allow", "error": None},
         check=_upstream_exactly("POST", "/dlp/s", (_PROSE + _PROSE_END).encode())),
    Case("DLP: a credential in a WebSocket message",
         {"host": "other.test", "target": "/dlp/ws", "headers": WS_UPGRADE,
          "ws": ["deploy with {GH}"]},
         ("ws-closed", 101, None), _DLP, engines=("h1", "mitmproxy"),
         check=_no_ws_message),
    Case("DLP: a credential in a .env of a zip after an image's bytes, a WebSocket message",
         {"host": "other.test", "target": "/dlp/ws", "headers": WS_UPGRADE,
          "ws": ["{WSBIN:{PNGZIP:GITHUB_TOKEN={GH}\n}}"]},
         ("ws-closed", 101, None), _DLP, engines=("h1", "mitmproxy"),
         check=_no_ws_message),
    Case("DLP: a credential in an absolute-form plain HTTP request",
         {"host": "other.test", "port": 80, "tls": False, "plain_proxy": True,
          "target": "http://other.test/dlp/p", "headers": [["X-Deploy", "{GH}"]]},
         ("response", 403, "secret_detected"), {**_DLP, "scheme": "http"},
         engines=("h1", "mitmproxy"), check=_no_upstream),
    Case("DLP: a credential dlp.allow lets go to this host",
         _dlp_post("/dlp-allow/j", "{B64:{\"note\": \"deploy with {GH}\"}}", _JSON),
         ("response", 200, None), {"decision": "allow", "error": None},
         check=_upstream_got(GH)),
    Case("DLP: a credential redacted from a JSON body",
         _dlp_post("/dlp-redact/j", "{B64:{\"note\": \"deploy with {GH}\"}}", _JSON),
         ("response", 200, None), {"decision": "allow", "error": None}, check=_redacted),
    Case("DLP: ordinary traffic passes",
         _dlp_post("/dlp/j", "{B64:{\"model\": \"m\", \"messages\": [{\"role\": "
                   "\"user\", \"content\": \"def key(): return os.environ['API_KEY']"
                   "\"}]}}", _JSON),
         ("response", 200, None), {"decision": "allow", "error": None},
         check=_upstream_got("API_KEY")),
]
CASES += DLP


def _fill(value: Any, subs: dict[str, str]) -> Any:
    if isinstance(value, str):
        if value.startswith("{B64:") and value.endswith("}"):
            return _b64(_fill(value[5:-1], subs))
        if value.startswith("{ZST:") and value.endswith("}"):
            return _zst(_fill(value[5:-1], subs))
        if value.startswith("{JSONZST:") and value.endswith("}"):  # (a .env.zst in JSON)
            return _json_file(_fill(value[9:-1], subs), "zst", 0, 4000)  # (words before
            # it: zstd codes the file's literals, else a short one is stored as it is)
        if value.startswith("{GZ:") and value.endswith("}"):
            return _gz(_fill(value[4:-1], subs))
        if value.startswith("{DEFLATE_TAIL:") and value.endswith("}"):  # (a clean deflate
            return base64.b64encode(zlib.compress(b"{}") + _fill(  # stream, then more)
                value[14:-1], subs).encode()).decode()
        if value.startswith("{GRPCGZ:") and value.endswith("}"):  # (a compressed message)
            return _grpc_gz(_fill(value[8:-1], subs))
        if value.startswith("{GRPCTEXT:") and value.endswith("}"):  # (its text form)
            return _grpc_text(_fill(value[10:-1], subs))
        if value.startswith("{GITPUSH:") and value.endswith("}"):  # (a deflated blob)
            return _git_push(_fill(value[9:-1], subs))
        if value.startswith("{TGZ:") and value.endswith("}"):  # (an uploaded .tar.gz)
            return _tar_gz(_fill(value[5:-1], subs))
        if value.startswith("{TGZ3M:") and value.endswith("}"):  # (past the hold limit)
            return _tar_gz(_fill(value[7:-1], subs), 3 * 1024 * 1024)
        if value.startswith("{ZIP:") and value.endswith("}"):
            return _zip(_fill(value[5:-1], subs))
        if value.startswith("{WSBIN:") and value.endswith("}"):  # (a binary message)
            return "bin:" + _fill(value[7:-1], subs)
        if value.startswith("{PNGZIP:") and value.endswith("}"):  # (an image and a zip)
            return _image_zip(_fill(value[8:-1], subs))
        if value.startswith("{PNGZIP3M:") and value.endswith("}"):  # (streamed)
            return _image_zip(_fill(value[10:-1], subs), 3 * 1024 * 1024)
        if value.startswith("{FORMZIP:") and value.endswith("}"):  # (a form's file part)
            return _upload_form(_fill(value[9:-1], subs))
        if value.startswith("{FORMZIP3M:") and value.endswith("}"):  # (streamed)
            return _upload_form(_fill(value[11:-1], subs), 3 * 1024 * 1024)
        if value.startswith(("{JSONGZ:", "{JSONLINES:")) and value.endswith("}"):  # (a
            how = "gz" if value.startswith("{JSONGZ:") else "lines"  # file in JSON)
            return _json_file(_fill(value[value.index(":") + 1:-1], subs), how)
        if value.startswith(("{JSONPZST:", "{JSONSKIPZST:")) and value.endswith("}"):
            how = "pzst" if value.startswith("{JSONPZST:") else "skipzst"  # (a .env.zst)
            return _json_file(_fill(value[value.index(":") + 1:-1], subs), how, 0, 4000)
        if value.startswith(("{JSONPZST2M:", "{JSONSKIPZST2M:")) and value.endswith("}"):
            how = "pzst" if value.startswith("{JSONPZST2M:") else "skipzst"  # (streamed)
            return _json_file(_fill(value[value.index(":") + 1:-1], subs), how, 2 << 20,
                              4000)
        if value.startswith("{PZST:") and value.endswith("}"):  # (an uploaded .zst)
            return base64.b64encode(_pzst((_filler(4000) + "\n" + _fill(
                value[6:-1], subs)).encode())).decode()
        if value.startswith("{JSONBIGGZ:") and value.endswith("}"):  # (a 2 MiB file)
            return _json_file(_fill(value[11:-1], subs), "gz", 0, 2 << 20)
        if value.startswith("{JSONPNGZIP") and value.endswith("}"):  # (`pngzip`: the
            how = "pngzip" + value[11:value.index(":")]  # digit, then M if streamed)
            return _json_file(_fill(value[value.index(":") + 1:-1], subs), how)
        if value.startswith(("{JSONGZ2M:", "{JSONLINES2M:")) and value.endswith("}"):
            how = "gz" if value.startswith("{JSONGZ2M:") else "lines"  # (streamed)
            return _json_file(_fill(value[value.index(":") + 1:-1], subs), how, 2 << 20)
        if value.startswith("{GZM:") and value.endswith("}"):  # (gzip, two members)
            return _gz_members(_fill(value[5:-1], subs))
        if value.startswith("{MPGZ:") and value.endswith("}"):  # (a form, a gzip part)
            return _multipart_gz(_fill(value[6:-1], subs))
        if value.startswith(("{U16BE:", "{U16LE:")) and value.endswith("}"):  # (no BOM)
            return _b64(_fill(value[7:-1], subs), f"utf-16-{value[4:6].lower()}")
        for k, v in subs.items():
            value = value.replace("{" + k + "}", v)
        return value
    if isinstance(value, list):
        return [_fill(v, subs) for v in value]
    return value


def substitutions(token: str) -> dict[str, str]:
    half = len(token) // 2
    return {"TOKEN": token, "KEY": KEY, "MINTED": MINTED, "PAYLOAD": token.split(".", 1)[1],
            "PAD": PAD, "GH": GH, "GH_PAD": "x" * ((2 << 20) - 20) + GH + "y" * 65536,
            "GH_ESCAPED": f"\\u{ord(GH[0]):04x}" + GH[1:], "PAD_2M": "x" * (2 << 20),
            "GH_ESCAPED_IN": f"\\\\u{ord(GH[0]):04x}" + GH[1:],  # (in a JSON string)
            "GH_PERCENT": f"%{ord(GH[0]):02X}" + GH[1:],
            "GH_QP": f"={ord(GH[0]):02X}" + GH[1:],
            "PEM_FLOOD": "BEGIN PRIVATE KEY " * 15_000,
            "NPM_FLOOD": ("//t" * 50 + "/:_authToken=") * 1280,
            "SPACES": " " * 65536, "SPACES_1K": " " * 1024, "CLOUDANT": "3f9a0c71" * 8,
            "AWS_SECRET": AWS_SECRET,
            "TOKEN_A": token[:half], "TOKEN_B": token[half:],
            "TOKEN_SWAPCASE": token.swapcase(),
            "PROSE": _PROSE, "PROSE_END": _PROSE_END}


def build_spec(case: Case, token: str, **where: Any) -> Spec:
    raw = {k: _fill(v, substitutions(token)) for k, v in case.spec.items()}
    raw["headers"] = [tuple(h) for h in raw.get("headers", [])]
    raw["trailers"] = [tuple(h) for h in raw.get("trailers", [])]
    return Spec(**{**raw, **where})


def deciding_line(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The line that decided the case: a deny if there is one, else the last line."""
    denies = [r for r in lines if r["decision"] == "deny"]
    assert lines, "no audit line for the case"
    return denies[-1] if denies else lines[-1]


DECISION_FIELDS = ("decision", "error", "host", "port", "rule", "credential")


def decision_fields(line: dict[str, Any]) -> dict[str, Any]:
    """The fields every engine must agree on (the rule as file name and line)."""
    out = {k: line[k] for k in DECISION_FIELDS}
    if out["credential"]:  # (an MCP OAuth grant's id is each gateway's own)
        out["credential"] = re.sub(r"og_[0-9a-f]+", "og_…", out["credential"])
    if out["rule"]:
        out["rule"] = Path(out["rule"].rsplit(":", 1)[0]).name + ":" + out["rule"].rsplit(":", 1)[1]
    return out


def new_lines(records: Callable[[], list[dict[str, Any]]], before: int, expected: int,
              settled: Callable[[], None]) -> list[dict[str, Any]]:
    """Audit lines written after `before` (an exchange's line comes once its response
    was relayed, a passthrough tunnel's when it closes) once `settled` returned (the
    gateway's connections ended and their lines written: `GatewayThread.settle`,
    `Lab.settle`), so a further line (a refusal followed by its connection's last line)
    is among them for a caller counting lines; up to 3 s for `expected` of them. Ask
    mode's own lines (`engine: approvals`: an ask a changed MCP tool opened, written in
    the background) are not the exchange's and are left out, as are an MCP OAuth
    grant's (`engine: mcp_oauth`: the consent completed while the exchange was held)."""
    def written() -> list[dict[str, Any]]:
        return [r for r in records()[before:]
                if r.get("engine") not in ("approvals", "mcp_oauth")]

    deadline = time.monotonic() + 3
    settled()  # (the client has closed: its connections end, their lines are written)
    while len(written()) < expected and time.monotonic() < deadline:
        time.sleep(0.01)
        settled()
    return written()
