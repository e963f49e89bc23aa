"""Upstream connections kept across client connections (gateway/engines/h1/pool.py).

A sandbox's next client connection to the same checked destination takes the upstream
connection its last one left idle; another sandbox never does; a parked connection is
closed after network.upstream_idle_timeout (the next connection then dials anew).
Each client connection here is a new CONNECT, TLS handshake and one request (httpx
Client per request), against the real TLS upstream.
"""

from __future__ import annotations

import ssl
import time

import httpx
import pytest
from helpers.gateway import GatewayFactory, GatewayThread
from helpers.metrics import metric
from helpers.upstream import Upstream

POLICY = """
version: v1
name: agent
egress:
  - host: other.test
    inspect: true
  - host: allowed.test
    inspect: true
"""


def _get(gw: GatewayThread, token: str, url: str, sandbox: str = "sandbox-1") -> None:
    """One request on a new client connection (a new httpx client: CONNECT + TLS)."""
    with httpx.Client(proxy=gw.proxy_url(token, sandbox), timeout=10,
                      verify=ssl.create_default_context(cafile=gw.ca_cert)) as client:
        assert client.get(url).status_code == 200


class Hows:
    """The upstream connections counter by `how`, from when this was made (the
    metrics registry is the process's, shared by every gateway of the test run)."""

    def __init__(self, gw: GatewayThread) -> None:
        self.gw = gw
        self.start = {h: self._read(h) for h in ("dialled", "pooled")}

    def _read(self, how: str) -> float:
        return metric(self.gw, "sandbox_gateway_upstream_connections_total", how=how)

    def __call__(self, how: str) -> float:
        return self._read(how) - self.start[how]


@pytest.fixture
def gw(make_gateway: GatewayFactory) -> GatewayThread:
    return make_gateway({"agent.yaml": POLICY})


def test_a_sandboxs_next_connection_takes_the_parked_upstream(gw: GatewayThread,
                                                               upstream: Upstream) -> None:
    token = gw.mint("agent")
    before, how = upstream.connections, Hows(gw)
    for _ in range(4):
        _get(gw, token, "https://other.test/ok/a")
    time.sleep(0.2)  # (the upstream server counts a connection when it serves it)
    assert upstream.connections - before == 1
    assert how("pooled") == 3
    lines = gw.audit.wait_for(lambda r: r["host"] == "other.test")
    assert len([r for r in lines if r["host"] == "other.test"]) == 4  # each audited


def test_never_across_sandboxes_or_destinations(gw: GatewayThread, upstream: Upstream) -> None:
    one, two = gw.mint("agent", sandbox="sandbox-1"), gw.mint("agent", sandbox="sandbox-2")
    before, how = upstream.connections, Hows(gw)
    _get(gw, one, "https://other.test/ok/a")
    _get(gw, two, "https://other.test/ok/a", sandbox="sandbox-2")  # another sandbox
    _get(gw, one, "https://allowed.test/x")  # another destination (same address)
    time.sleep(0.2)
    assert upstream.connections - before == 3
    assert how("pooled") == 0
    _get(gw, two, "https://other.test/ok/a", sandbox="sandbox-2")  # its own, parked
    _get(gw, one, "https://other.test/ok/a")
    assert how("pooled") == 2
    time.sleep(0.2)
    assert upstream.connections - before == 3


def test_parked_connections_expire(make_gateway: GatewayFactory, upstream: Upstream) -> None:
    gw = make_gateway({"agent.yaml": POLICY},
                      config={"network": {"upstream_idle_timeout": "300ms"}})
    token, how = gw.mint("agent"), Hows(gw)
    _get(gw, token, "https://other.test/ok/a")
    assert how("dialled") == 1
    time.sleep(1.0)  # past the idle timeout: the sweeper closed the parked connection
    assert len(gw.gateway.doors.h1.pool) == 0
    _get(gw, token, "https://other.test/ok/a")
    assert (how("pooled"), how("dialled")) == (0, 2)
