"""Refusal hints through a real gateway: a hard-denied address is never told to add a rule."""

from __future__ import annotations

import httpx
import pytest
from helpers.clients import raw_connect
from helpers.gateway import GatewayThread


@pytest.mark.parametrize("authority", ["169.254.169.254:80", "[fe80::1]:443",
                                       "0251.0376.0251.0376:80"])
def test_metadata_address_is_never_openable(gateway: GatewayThread, authority: str) -> None:
    token = gateway.mint("agent")
    status, _, body = raw_connect(gateway.gateway.proxy_address, authority, token)
    assert status == 403 and body is not None and body["error"] == "policy_denied"
    assert "the gateway never connects to it" in body["reason"]
    assert "no rule can allow it" in body["reason"]
    assert "add an egress rule" not in body["reason"]


def test_metadata_address_plain_http(gateway: GatewayThread) -> None:
    token = gateway.mint("agent")
    r = httpx.get("http://169.254.169.254/latest/meta-data/", proxy=gateway.proxy_url(token),
                  timeout=10)
    assert r.status_code == 403
    assert "169.254.169.254 is a link-local (cloud metadata) address" in r.json()["reason"]


def test_private_address_hint_names_allow_cidrs(gateway: GatewayThread) -> None:
    token = gateway.mint("agent")
    _, _, body = raw_connect(gateway.gateway.proxy_address, "10.0.0.7:443", token)
    assert body is not None and "add an egress rule with host: 10.0.0.7" in body["reason"]
    assert "network.allow_cidrs must also include it" in body["reason"]
