"""Fixtures for the fault and soak suite: a real nginx upstream and gateways in front of it.

Names reach nginx only through the gateway's `network.resolve` (operator-trusted
overrides to 127.0.0.1); nothing here dials anything off-box.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.gateway import GatewayFactory, GatewayThread
from helpers.nginx import Nginx
from helpers.tls import LocalCA

NAMES = ["pass.test", "inspect.test"]

POLICY = """
version: v1
name: agent
egress:
  - host: pass.test
  - host: inspect.test
    methods: [GET, HEAD, POST]
"""


@pytest.fixture(scope="session")
def test_ca(tmp_path_factory: pytest.TempPathFactory) -> LocalCA:
    return LocalCA.create(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def nginx(test_ca: LocalCA, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nginx]:
    server = Nginx(tmp_path_factory.mktemp("nginx"), test_ca, NAMES)
    yield server
    server.stop()





@pytest.fixture
def make_gateway(tmp_path: Path, test_ca: LocalCA) -> Iterator[GatewayFactory]:
    started: list[GatewayThread] = []

    def factory(port: int, policy: str = POLICY, config: dict[str, Any] | None = None,
                ) -> GatewayThread:
        pdir = tmp_path / "policies"
        pdir.mkdir(exist_ok=True)
        (pdir / "agent.yaml").write_text(policy)
        cfg: dict[str, Any] = {
            "network": {"upstream_ca": str(test_ca.cert_path),
                        "resolve": {n: f"127.0.0.1:{port}" for n in NAMES}},
            "secrets": {"store": "env"},
        }
        for key, value in (config or {}).items():
            if isinstance(value, dict) and isinstance(cfg.get(key), dict):
                cfg[key] = {**cfg[key], **value}
            else:
                cfg[key] = value
        gw = GatewayThread(tmp_path, cfg)
        started.append(gw)
        return gw

    yield factory
    for gw in started:
        gw.stop()
