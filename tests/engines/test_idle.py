"""The mitmproxy engine closes an intercepted tunnel's idle upstream connection after
`network.upstream_idle_timeout` (gateway/engines/idle.py) and opens a new one for the
next request, the sandbox's tunnel staying open; 0 never closes it. On a real gateway
whose intercepted tunnels mitmproxy serves (`network.intercept: mitmproxy`), a real
httpx client and a real TLS upstream. (The HTTP/1 engine's own idle close:
tests/integration/test_intercept_path.py and test_proxy_basics.py.)"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.gateway import GatewayThread
from helpers.tls import LocalCA
from helpers.upstream import Upstream, start_upstream

POLICY = "version: v1\nname: agent\negress:\n  - host: other.test\n    inspect: true\n"


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> LocalCA:
    return LocalCA.create(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def upstream(ca: LocalCA, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstream]:
    server = start_upstream(ca.server_context(tmp_path_factory.mktemp("leaf"), ["other.test"]))
    yield server
    server.close()


def _gateway(tmp_path: Path, ca: LocalCA, upstream: Upstream, idle: str) -> GatewayThread:
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "agent.yaml").write_text(POLICY)
    return GatewayThread(tmp_path, {
        "network": {"intercept": "mitmproxy", "upstream_idle_timeout": idle,
                    "upstream_ca": str(ca.cert_path),
                    "resolve": {"other.test": f"127.0.0.1:{upstream.port}"}},
        "secrets": {"store": "env"}})


@pytest.mark.parametrize(("idle", "dialled"), [("1s", 2), ("0", 1)])
def test_an_idle_upstream_is_closed_and_the_next_request_dials_anew(
        tmp_path: Path, ca: LocalCA, upstream: Upstream, idle: str, dialled: int) -> None:
    gw = _gateway(tmp_path, ca, upstream, idle)
    try:
        proxy = gw.proxy_url(gw.mint("agent"))
        verify = ssl.create_default_context(cafile=str(gw.ca_cert))
        with httpx.Client(proxy=proxy, verify=verify, timeout=10) as client:
            before = upstream.connections
            assert client.get("https://other.test/first").status_code == 200
            assert client.get("https://other.test/second").status_code == 200
            assert upstream.connections == before + 1  # kept while in use
            time.sleep(2.5)  # past 1s, and the sweep's half-second tick
            third = client.get("https://other.test/third")  # the same tunnel
            assert third.status_code == 200 and third.json()["path"] == "/third"
            assert upstream.connections == before + dialled
        assert gw.audit.wait_for(lambda r: r["path"] == "/third")  # (written just after)
        lines = [r for r in gw.audit.records()
                 if r["host"] == "other.test" and r["method"] == "GET"]
        assert [(r["path"], r["engine"]) for r in lines] == [
            ("/first", "mitmproxy"), ("/second", "mitmproxy"), ("/third", "mitmproxy")]
    finally:
        gw.stop()
