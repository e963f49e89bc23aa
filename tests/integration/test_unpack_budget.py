"""One sandbox's compressed data cannot keep a worker busy unpacking
(`limits.unpacked_excess`, `pipeline/unpacking.py`), on each engine: a sandbox sending
bodies that unpack to many times their size is refused once its bucket is spent, saying
why; another sandbox's same body, and the first sandbox's ordinary ones, go through.
(Before the twenty-first session each 40 KB body unpacked to 30 MiB, a few tenths of a
second of a worker's CPU, as often as a sandbox's 256 connections sent them.)"""

from __future__ import annotations

import base64
import gzip
import json
from typing import Any

import pytest
from helpers.gateway import GatewayFactory, GatewayThread
from helpers.parity import Spec, run

POLICY = """
version: v1
name: agent
dlp: {action: refuse}
egress:
  - host: other.test
"""
BOMB = json.dumps({"content": base64.b64encode(
    gzip.compress(b"\0" * (30 << 20), mtime=0)).decode()}).encode()
ORDINARY = json.dumps({"content": base64.b64encode(gzip.compress(
    b" ".join(b"line %d of the build log" % i for i in range(20_000)), mtime=0)).decode()})


def _send(gw: GatewayThread, sandbox: str, body: bytes) -> Any:
    assert gw.gateway.proxy_address is not None
    token = gw.mint("agent", sandbox)
    cred = base64.b64encode(f"{sandbox}:{token}".encode()).decode()
    return run(Spec(host="other.test", method="POST", target="/upload",
                    headers=[("Content-Type", "application/json")],
                    body=base64.b64encode(body).decode(), proxy=gw.gateway.proxy_address,
                    proxy_auth=f"Basic {cred}", cafile=str(gw.ca_cert)))


@pytest.mark.parametrize("engine", ["fast", "mitmproxy"])
def test_a_sandbox_past_its_unpacking_bucket_is_refused_alone(
        make_gateway: GatewayFactory, engine: str) -> None:
    gw = make_gateway({"agent.yaml": POLICY}, {
        "network": {"intercept": engine},
        "limits": {"unpacked_excess": 80 << 20, "unpacked_excess_rate": 1024}})
    first = _send(gw, "sandbox-1", BOMB)  # (both checks unpack it: 2 x 29.5 MiB charged)
    assert (first.stage, first.status) == ("response", 200), first
    refused = _send(gw, "sandbox-1", BOMB)
    assert refused.status in (400, 403) and refused.code in ("bad_request", "secret_detected")
    assert "this sandbox's compressed data" in refused.body, refused.body
    other = _send(gw, "sandbox-2", BOMB)  # (its own bucket)
    assert (other.stage, other.status) == ("response", 200), other
    ordinary = _send(gw, "sandbox-1", ORDINARY.encode())  # (packs 5 times: not charged)
    assert (ordinary.stage, ordinary.status) == ("response", 200), ordinary
