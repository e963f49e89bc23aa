"""Optional subsystems are imported only when configured (issue 22, memory): the Azure SDK
for `secrets.store: azure-keyvault`, aiohttp for minted credentials, dnspython for
`listen.dns`; and of mitmproxy's addons only those the gateway runs. Measured before:
every gateway process imported all of them (37 MB of its ~100 MB at start). The real
`sandbox-gateway run`, under `python -X importtime`."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml
from helpers.process import free_port

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL = ("azure", "msal", "aiohttp", "dns")
MINTED = """
credentials:
  internal:
    type: oauth2-client-credentials
    token_url: https://login.example.test/oauth2/token
    client_id: gateway-client
    client_secret: oauth-client-secret
    hosts: [api.internal.test]
"""


def _imported(tmp_path: Path, policy_extra: str = "", dns: bool = False) -> set[str]:
    """The top-level packages a gateway process imported by the time it was ready."""
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "agent.yaml").write_text(
        "version: v1\nname: agent\negress:\n  - host: allowed.test\n" + policy_extra)
    admin = free_port()
    listen = {"proxy": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{admin}"}
    if dns:
        listen["dns"] = f"127.0.0.1:{free_port()}"
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump({
        "listen": listen, "policies": "policies", "certs": "certs", "workers": 1,
        "secrets": {"store": "env"}, "audit": {"path": str(tmp_path / "audit.log")}}))
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "gateway", "run",
                                 "--config", str(tmp_path / "gateway.yaml")],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 30
            while True:
                assert proc.poll() is None, log.read_text()[-2000:]
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{admin}/readyz", timeout=1)
                    break
                except OSError:
                    assert time.monotonic() < deadline, "not ready in 30 s"
                    time.sleep(0.1)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(15)
    return {line.rsplit("|", 1)[1].strip()
            for line in log.read_text().splitlines() if line.startswith("import time:")}


def _packages(modules: set[str]) -> set[str]:
    return {name.split(".")[0] for name in modules}


def test_a_plain_gateway_imports_no_optional_subsystem(tmp_path: Path) -> None:
    modules = _imported(tmp_path)
    imported = _packages(modules)
    assert "mitmproxy" in imported  # (the check sees what is imported)
    assert not imported & set(OPTIONAL), sorted(imported & set(OPTIONAL))
    # mitmproxy's addons: the four the gateway uses, not the thirty mitmdump loads
    # (`patches.lean_addons`: 15 MB).
    addons = {m.split(".")[2] for m in modules if m.startswith("mitmproxy.addons.")}
    assert {"core", "proxyserver", "tlsconfig", "next_layer"} <= addons
    assert "blocklist" not in addons and "proxyauth" not in addons, sorted(addons)
    assert "ldap3" not in imported  # (proxyauth's)


def test_the_dns_resolver_imports_dnspython(tmp_path: Path) -> None:
    assert "dns" in _packages(_imported(tmp_path, dns=True))


def test_a_minted_credential_imports_aiohttp_at_its_first_mint_only(tmp_path: Path) -> None:
    imported = _packages(_imported(tmp_path, MINTED))
    assert "aiohttp" not in imported and "azure" not in imported
