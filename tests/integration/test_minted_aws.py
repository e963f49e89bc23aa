"""AWS SigV4 re-signing: the real boto3 Bedrock runtime client in a sandbox process that
holds placeholder keys and its gateway token (as AWS_SESSION_TOKEN) calls `converse`,
`converse_stream` and `invoke_model_with_response_stream` through the gateway; a fake
Bedrock recomputes every signature with the real secret; keys come from the store, from
STS AssumeRole, or from web identity."""

from __future__ import annotations

import base64
import json
import logging
import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fakes.aws import FakeAws
from helpers import parity
from helpers.gateway import GatewayFactory, GatewayThread
from helpers.metrics import metric

from gateway.tools.sandbox_env import sandbox_env

RUNTIME = "bedrock-runtime.us-east-1.amazonaws.com"
MODEL = "anthropic.claude-3-5-sonnet-20240620-v1:0"
POLICY = """
version: v1
name: agent
egress:
  - host: bedrock-runtime.us-east-1.amazonaws.com
    credential: bedrock
credentials:
  bedrock:
    type: aws-sigv4
    service: bedrock
    region: us-east-1
{keys}
"""
STATIC = "    access_key_id: aws-key-id\n    secret_access_key: aws-secret-key\n"
ROLE = STATIC + "    role_arn: {role}\n    duration: 15m\n"
WEB = "    web_identity: true\n    role_arn: {role}\n    token_file: {token_file}\n"

SANDBOX = r"""
import json, boto3
client = boto3.client("bedrock-runtime", region_name="us-east-1")
messages = [{"role": "user", "content": [{"text": "say hello"}]}]
out = {}
reply = client.converse(modelId=MODEL, messages=messages)
out["converse"] = reply["output"]["message"]["content"][0]["text"]
out["usage"] = reply["usage"]["totalTokens"]
stream = client.converse_stream(modelId=MODEL, messages=messages)
out["stream"] = "".join(e["contentBlockDelta"]["delta"]["text"] for e in stream["stream"]
                        if "contentBlockDelta" in e)
invoked = client.invoke_model_with_response_stream(
    modelId=MODEL, body=json.dumps({"anthropic_version": "bedrock-2023-05-31",
                                    "max_tokens": 10, "messages": [
                                        {"role": "user", "content": "hi"}]}))
out["invoke"] = "".join(json.loads(e["chunk"]["bytes"])["delta"]["text"]
                        for e in invoked["body"] if "chunk" in e)
print(json.dumps(out))
""".replace("MODEL", repr(MODEL))


@pytest.fixture
def aws(tmp_path: Path) -> Iterator[FakeAws]:
    with FakeAws(tmp_path / "aws") as fake:
        assert isinstance(fake, FakeAws)
        yield fake


def _gateway(make_gateway: GatewayFactory, tmp_path: Path, aws: FakeAws, mode: str,
             intercept: str = "fast") -> GatewayThread:
    secrets = tmp_path / "secrets.yaml"
    secrets.write_text(f"aws-key-id: {aws.base_id}\naws-secret-key: {aws.base_secret}\n")
    secrets.chmod(0o600)
    token_file = tmp_path / "web-identity-token"
    token_file.write_text(aws.web_identity_token)
    keys = {"static": STATIC, "role": ROLE, "web": WEB}[mode].format(
        role=aws.role_arn, token_file=token_file)
    return make_gateway({"agent.yaml": POLICY.format(keys=keys)}, config={
        "secrets": {"store": "file", "path": str(secrets)},
        "network": {"upstream_ca": str(aws.ca_path), "resolve": aws.resolve(),
                    "intercept": intercept}})


def _sandbox_env(gw: GatewayThread, token: str, home: Path) -> dict[str, str]:
    home.mkdir(exist_ok=True)
    env = dict(line.split("=", 1) for line in sandbox_env(token, gw.proxy,
                                                          ca_bundle=str(gw.ca_cert)))
    env.update({"PATH": os.environ["PATH"], "HOME": str(home),
                "AWS_EC2_METADATA_DISABLED": "true", "PYTHONPATH": os.pathsep.join(sys.path)})
    return env


@pytest.mark.parametrize(("mode", "intercept"), [("static", "fast"), ("role", "fast"),
                                                 ("web", "fast"), ("role", "mitmproxy")])
def test_boto3_bedrock_through_the_gateway(make_gateway: GatewayFactory, tmp_path: Path,
                                           aws: FakeAws, mode: str, intercept: str,
                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    gw = _gateway(make_gateway, tmp_path, aws, mode, intercept)
    token = gw.mint("agent")
    before = metric(gw, "sandbox_gateway_credential_mints_total", type="aws-sigv4",
                    result="ok")
    env = _sandbox_env(gw, token, tmp_path / "home")
    out = subprocess.run([sys.executable, "-c", SANDBOX], env=env, capture_output=True,
                         text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-3000:] + gw.audit.getvalue()[-2000:]
    result = json.loads(out.stdout)
    assert result == {"converse": "Hello from Bedrock.", "usage": 8,
                      "stream": "Hello from Bedrock.", "invoke": "Hello from Bedrock."}
    # Every request was verified against the real secret, signed by the expected key.
    runtime = [v for v in aws.verified if v[0].startswith("/model/")]
    assert not aws.failures and len(runtime) == 3
    expected = {"static": [], "role": ["AssumeRole"],
                "web": ["AssumeRoleWithWebIdentity"]}[mode]
    assert aws.assumed == expected  # one STS call for all three requests
    temp = aws.temp_keys()
    key_id = temp[0][0] if temp else aws.base_id
    assert {k for _, k, _ in runtime} == {key_id}
    # Whole bodies were signed (their SHA-256), and reached the fake as sent.
    assert all(len(h) == 64 for _, _, h in runtime)
    assert b'"say hello"' in aws.bodies[0]
    assert metric(gw, "sandbox_gateway_credential_mints_total", type="aws-sigv4",
                  result="ok") == before + 1
    # Nothing the sandbox or an operator reads holds a real key or the session token.
    text = out.stdout + out.stderr + gw.audit.getvalue() + caplog.text + \
        httpx.get(f"{gw.admin}/metrics").text
    secrets = [aws.base_secret] + [k.secret for _, k in temp] + \
        [str(k.token) for _, k in temp]
    assert not [s for s in secrets if s in text]
    for request in aws.requests:
        assert token not in repr(request.headers) and token.encode() not in request.body
        if request.host == RUNTIME:
            assert "SANDBOXGATEWAYPLACEHOLDER" not in request.headers["authorization"]
    lines = [r for r in gw.audit.records() if r.get("credential") == "bedrock"]
    assert len(lines) == 3 and all(r["status"] == 200 for r in lines)


def _client(gw: GatewayThread, token: str) -> httpx.Client:
    return httpx.Client(proxy=gw.proxy_url(token), timeout=30,
                        verify=ssl.create_default_context(cafile=gw.ca_cert))


def _placeholder_auth(token: str) -> dict[str, str]:
    """What a client signing with the placeholder keys sends (never checked)."""
    return {"Authorization": "AWS4-HMAC-SHA256 Credential=SANDBOXGATEWAYPLACEHOLDER/20250101/"
                             "us-east-1/bedrock/aws4_request, SignedHeaders=host;x-amz-date, "
                             "Signature=" + "0" * 64,
            "X-Amz-Date": "20250101T000000Z", "X-Amz-Security-Token": token,
            "Content-Type": "application/json"}


@pytest.mark.parametrize("intercept", ["fast", "mitmproxy"])
def test_payload_modes(make_gateway: GatewayFactory, tmp_path: Path, aws: FakeAws,
                       intercept: str) -> None:
    gw = _gateway(make_gateway, tmp_path, aws, "static", intercept)
    token = gw.mint("agent")
    url = f"https://{RUNTIME}/model/m/converse"
    body = json.dumps({"messages": [{"role": "user", "content": [{"text": "x" * 2_000_000}]}]})
    with _client(gw, token) as client:
        # UNSIGNED-PAYLOAD: signed at once, the (large) body streams after the head.
        unsigned = client.post(url, content=body.encode(), headers={
            **_placeholder_auth(token), "x-amz-content-sha256": "UNSIGNED-PAYLOAD"})
        assert unsigned.status_code == 200, unsigned.text
        assert aws.verified[-1][2] == "UNSIGNED-PAYLOAD" and aws.bodies[-1] == body.encode()
        # A digest the client computed is replaced by the real body's.
        digest = client.post(url, content=b'{"messages": []}', headers={
            **_placeholder_auth(token), "x-amz-content-sha256": "ab" * 32})
        assert digest.status_code == 200, digest.text
        # Chunk signing cannot be redone with other keys: refused with a reason.
        chunked = client.post(url, content=b"0;chunk-signature=00\r\n\r\n", headers={
            **_placeholder_auth(token),
            "x-amz-content-sha256": "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"})
        assert chunked.status_code == 501
        assert "UNSIGNED-PAYLOAD" in chunked.json()["reason"]
        presigned = client.get(f"https://{RUNTIME}/model/m/x?X-Amz-Signature=00&"
                               "X-Amz-Credential=a", headers={"X-Amz-Security-Token": token})
        assert presigned.status_code == 501 and "presigned" in presigned.json()["reason"]

        # A body of unknown length must stream: it cannot be signed before its head.
        def pieces() -> Iterator[bytes]:
            yield b'{"messages": '
            yield b"[]}"

        streamed = client.post(url, content=pieces(), headers=_placeholder_auth(token))
        if intercept == "fast":  # read whole (it ends within the limit), signed, sent
            assert streamed.status_code == 200, streamed.text
        else:  # mitmproxy streams a body of unknown length: refused before the head
            assert streamed.status_code == 501
            assert "whole body" in streamed.json()["reason"]
    # HTTP/2 from the sandbox (served by mitmproxy; :authority, no Host): signed in its
    # `request` hook, then sent to the HTTP/1 upstream.
    assert gw.gateway.proxy_address is not None
    h2 = parity.run(parity.Spec(
        host=RUNTIME, method="POST", target="/model/m/converse", h2=True,
        headers=list(_placeholder_auth(token).items()),
        body=base64.b64encode(b'{"messages": []}').decode(), proxy=gw.gateway.proxy_address,
        proxy_auth="Basic " + base64.b64encode(f"sandbox-1:{token}".encode()).decode(),
        cafile=str(gw.ca_cert)))
    assert (h2.stage, h2.status) == ("response", 200), h2
    assert aws.verified[-1][0] == "/model/m/converse"
    # An absolute-form target inside the tunnel: signed as forwarded (origin-form).
    absolute = parity.run(parity.Spec(
        host=RUNTIME, method="POST", target=f"https://{RUNTIME}/model/m/converse",
        headers=[*_placeholder_auth(token).items(), ("x-amz-content-sha256", "UNSIGNED-PAYLOAD")],
        body=base64.b64encode(b'{"messages": []}').decode(), proxy=gw.gateway.proxy_address,
        proxy_auth="Basic " + base64.b64encode(f"sandbox-1:{token}".encode()).decode(),
        cafile=str(gw.ca_cert)))
    assert (absolute.stage, absolute.status) == ("response", 200), absolute
    assert aws.verified[-1][2] == "UNSIGNED-PAYLOAD"
    assert len(aws.failures) == 0


def test_a_body_over_the_limit_is_refused_unless_unsigned(
        make_gateway: GatewayFactory, tmp_path: Path, aws: FakeAws) -> None:
    from gateway.pipeline.exchange import SIGNED_BODY_LIMIT

    gw = _gateway(make_gateway, tmp_path, aws, "static")
    token = gw.mint("agent")
    url = f"https://{RUNTIME}/model/m/converse"
    big = b"x" * (SIGNED_BODY_LIMIT + 1024)
    seen = len(aws.requests)
    with _client(gw, token) as client:
        refused = client.post(url, content=big, headers=_placeholder_auth(token))
    assert refused.status_code == 501 and "UNSIGNED-PAYLOAD" in refused.json()["reason"]
    assert len(aws.requests) == seen  # nothing reached the upstream


def test_sts_refusal_answers_503_credential_unavailable(
        make_gateway: GatewayFactory, tmp_path: Path, aws: FakeAws) -> None:
    aws.role_arn = "arn:aws:iam::123456789012:role/another"  # the policy's role is refused
    gw = _gateway(make_gateway, tmp_path, aws, "role")
    aws.role_arn = "arn:aws:iam::123456789012:role/bedrock-agent-x"
    token = gw.mint("agent")
    with _client(gw, token) as client:
        r = client.post(f"https://{RUNTIME}/model/m/converse", content=b"{}",
                        headers=_placeholder_auth(token))
    assert r.status_code == 503 and r.json()["error"] == "credential_unavailable"
    assert "AccessDenied" in r.json()["reason"] and aws.base_secret not in r.text
