"""Transparent mode for real: a sandbox network namespace whose TCP is REDIRECTed by
iptables into the gateway, which runs (as a real process) in its own namespace with
the upstream on a local address. Nothing leaves this machine: both namespaces are
private, linked only to each other."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.netns import (
    CANARY_IP,
    NETNS,
    SANDBOX_IP,
    UPSTREAM_IP,
    Lab,
    transparent_lab,
    unavailable,
)

pytestmark = pytest.mark.netns

POLICY = """
version: v1
name: agent
egress:
  - host: allowed.test           # passthrough
  - host: inspect.test
    inspect: true
  - host: key.test
    credential: key
credentials:
  key: {hosts: [key.test], secret: key-secret, inject: {header: X-Api-Key}}
"""


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    why = unavailable()
    if why:
        pytest.fail(why)
    with transparent_lab(tmp_path, policy=POLICY, names=["allowed.test", "inspect.test",
                                                         "key.test"],
                         secrets={"key-secret": "real-key-for-key-test-0123456789"}) as lab:
        yield lab


def test_transparent_mode_end_to_end(lab: Lab) -> None:
    # Unregistered source, no token: refused (a passthrough host cannot be identified).
    r = lab.sandbox_curl("https://allowed.test/x", UPSTREAM_IP, "--cacert", str(lab.ca.cert_path))
    assert r.returncode != 0

    lab.register()
    # Passthrough: the sandbox sees the upstream's own certificate (no gateway CA).
    r = lab.sandbox_curl("https://allowed.test/hello", UPSTREAM_IP,
                         "--cacert", str(lab.ca.cert_path))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["path"] == "/hello"
    # Intercepted: the sandbox trusts the gateway CA; the request is decided.
    gw_ca = str(lab.gateway_ca)
    r = lab.sandbox_curl("https://inspect.test/in", UPSTREAM_IP, "--cacert", gw_ca)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["path"] == "/in"
    # An HTTP/2-only client, redirected: handed to mitmproxy, started for it on demand
    # (network.intercept: fast), and decided there.
    got = lab.sandbox_client({"host": "inspect.test", "target": "/h2", "h2": True,
                              "cafile": gw_ca, "connect_to": [UPSTREAM_IP, 443]})
    assert (got["stage"], got["status"]) == ("response", 200), got
    assert json.loads(got["body"])["path"] == "/h2"
    line = lab.audit_until(lambda a: a.get("path") == "/h2")[-1]
    assert line["engine"] == "mitmproxy" and line["decision"] == "allow", line
    # A name the policy does not allow: refused.
    r = lab.sandbox_curl("https://evil.test/", UPSTREAM_IP, "--cacert", str(lab.ca.cert_path))
    assert r.returncode != 0
    # An allowed name paired with another address (spoofed): refused, never dialled.
    r = lab.sandbox_curl("https://allowed.test/", CANARY_IP, "--cacert", str(lab.ca.cert_path))
    assert r.returncode != 0
    assert lab.canary_hits() == 0

    # Unregistered again: identity from a gateway token in the credential carrier.
    assert "removed" in lab.admin("DELETE", f"/v1/sandboxes/{SANDBOX_IP}")
    token = lab.mint()
    r = lab.sandbox_curl("https://key.test/k", UPSTREAM_IP, "--cacert", gw_ca,
                         "-H", f"X-Api-Key: {token}")
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)["headers"]
    # The upstream echoes the headers it got: the real key arrived (and the gateway
    # redacted its echo on the way back); the token did not.
    assert seen.get("x-api-key") == "[REDACTED]"
    assert token not in r.stdout
    r = lab.sandbox_curl("https://inspect.test/no-token", UPSTREAM_IP, "--cacert", gw_ca)
    assert '"unknown_sandbox"' in r.stdout
    assert lab.canary_hits() == 0


def test_netns_script_is_usable_by_hand() -> None:
    """The trial script documents its usage (and refuses unknown commands)."""
    out = subprocess.run([str(NETNS), "sideways"], capture_output=True, text=True)
    assert out.returncode == 2 and "usage" in out.stderr

