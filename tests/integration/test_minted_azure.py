"""Entra ID tokens minted by the gateway with azure-identity (workload identity against
the local Entra ID fake), injected as Bearer for Azure OpenAI: the official `openai`
SDK's AzureOpenAI client in a sandbox sends only its gateway token (as the api-key)."""

from __future__ import annotations

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
from fakes.inference import FakeInference
from fakes.keyvault import AUTHORITY_HOST, FakeKeyVault
from helpers.gateway import GatewayFactory, GatewayThread
from helpers.metrics import metric

from gateway.tools.sandbox_env import sandbox_env

SCOPE = "https://cognitiveservices.azure.com/.default"
RESOURCE = "contoso.openai.azure.com"
POLICY = """
version: v1
name: agent
egress:
  - host: "*.openai.azure.com"
    credential: aoai
credentials:
  aoai:
    type: azure-entra
    credential: workload
    tenant_id: {tenant}
    client_id: {client}
    token_file: {token_file}
"""
SANDBOX = r"""
import json, os, openai
client = openai.AzureOpenAI(azure_endpoint="https://contoso.openai.azure.com",
                            api_version="2024-06-01", max_retries=0)
chat = client.chat.completions.create(model="gpt-4o", messages=[
    {"role": "user", "content": "hello there"}])
stream = client.chat.completions.create(model="gpt-4o", stream=True, messages=[
    {"role": "user", "content": "count"}])
text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
print(json.dumps({"chat": chat.choices[0].message.content, "stream": text}))
"""


@pytest.fixture
def entra(tmp_path: Path) -> Iterator[FakeKeyVault]:
    with FakeKeyVault(tmp_path / "entra", scopes={SCOPE}) as fake:
        yield fake


@pytest.fixture
def aoai(tmp_path: Path, entra: FakeKeyVault) -> Iterator[FakeInference]:
    with FakeInference(tmp_path / "aoai", api_key="no-static-key-here",
                       entra=lambda token: entra.issued(token, SCOPE)) as fake:
        yield fake


def _gateway(make_gateway: GatewayFactory, tmp_path: Path, entra: FakeKeyVault,
             aoai: FakeInference, intercept: str = "fast") -> GatewayThread:
    bundle = tmp_path / "upstream-cas.pem"
    bundle.write_bytes(entra.ca_path.read_bytes() + aoai.ca_path.read_bytes())
    policy = POLICY.format(tenant=entra.tenant_id, client=entra.client_id,
                           token_file=entra.token_file)
    return make_gateway({"agent.yaml": policy}, config={
        "network": {"upstream_ca": str(bundle), "intercept": intercept,
                    "resolve": {AUTHORITY_HOST: f"127.0.0.1:{entra.port}",
                                RESOURCE: f"127.0.0.1:{aoai.port}"}}})


@pytest.mark.parametrize("intercept", ["fast", "mitmproxy"])
def test_azure_openai_sdk_with_an_entra_token(make_gateway: GatewayFactory, tmp_path: Path,
                                              entra: FakeKeyVault, aoai: FakeInference,
                                              intercept: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    gw = _gateway(make_gateway, tmp_path, entra, aoai, intercept)
    token = gw.mint("agent")
    before = metric(gw, "sandbox_gateway_credential_mints_total", type="azure-entra",
                    result="ok")
    env = dict(line.split("=", 1) for line in sandbox_env(token, gw.proxy,
                                                          ca_bundle=str(gw.ca_cert)))
    env.update({"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
    out = subprocess.run([sys.executable, "-c", SANDBOX], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:] + gw.audit.getvalue()[-2000:]
    result = json.loads(out.stdout)
    assert result["chat"] == "The fake provider answers."
    assert result["stream"] == "The fake provider answers."
    # One Entra ID token request (a client assertion for the Cognitive Services scope)
    # served both calls; the upstream saw it as Bearer and no api-key at all.
    assert [r["scope"] for r in entra.token_requests] == [SCOPE]
    assert len(aoai.requests) == 2
    minted = {r.headers["authorization"][7:] for r in aoai.requests}
    assert len(minted) == 1 and all("api-key" not in r.headers for r in aoai.requests)
    assert entra.issued(minted.pop(), SCOPE) is True
    assert metric(gw, "sandbox_gateway_credential_mints_total", type="azure-entra",
                  result="ok") == before + 1
    bearer = aoai.requests[0].headers["authorization"][7:]
    text = out.stdout + out.stderr + gw.audit.getvalue() + caplog.text + \
        httpx.get(f"{gw.admin}/metrics").text
    assert bearer not in text and entra.federated_token not in text


def test_a_revoked_entra_token_is_minted_afresh(make_gateway: GatewayFactory, tmp_path: Path,
                                                entra: FakeKeyVault,
                                                aoai: FakeInference) -> None:
    """azure-identity caches tokens: after a 401 the gateway rebuilds the credential, so
    the rejected token is not handed back."""
    gw = _gateway(make_gateway, tmp_path, entra, aoai)
    token = gw.mint("agent")
    url = f"https://{RESOURCE}/openai/deployments/gpt-4o/chat/completions?api-version=2024-06-01"
    body = {"messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(proxy=gw.proxy_url(token), timeout=20,
                      verify=ssl.create_default_context(cafile=gw.ca_cert)) as client:
        assert client.post(url, json=body, headers={"api-key": token}).status_code == 200
        first = aoai.requests[-1].headers["authorization"][7:]
        entra.revoke(first)
        assert client.post(url, json=body, headers={"api-key": token}).status_code == 401
        assert client.post(url, json=body, headers={"api-key": token}).status_code == 200
        second = aoai.requests[-1].headers["authorization"][7:]
    assert second != first and len(entra.token_requests) == 2
