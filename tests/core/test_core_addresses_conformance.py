"""Conformance: ../shared/conformance/egress_cases.yaml (ip_classification, authority_parsing)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from conformance import CASES_FILE

from gateway.core.addresses import AddressPolicy, Verdict
from gateway.core.names import DestinationError, parse_authority

if not CASES_FILE.exists():  # pragma: no cover - only outside the project checkout
    pytest.skip(f"conformance data not found at {CASES_FILE}", allow_module_level=True)

DATA: dict[str, Any] = yaml.safe_load(CASES_FILE.read_text(encoding="utf-8"))
IPC: dict[str, Any] = DATA["ip_classification"]


def _policy(config: dict[str, Any], **extra: Any) -> AddressPolicy:
    """Map the smokescreen config names onto AddressPolicy."""
    own = [(ip, config["proxy_port"]) for ip in config.get("proxy_local_ips", ())]
    return AddressPolicy(
        allow_cidrs=config.get("allow_ranges", ()),
        deny_cidrs=config.get("deny_ranges", ()),
        allow_addresses=config.get("allow_addresses", ()),
        deny_addresses=config.get("deny_addresses", ()),
        own_addresses=own,
        **extra,
    )


SMOKESCREEN = _policy(IPC["config"])


def _check(verdict: Verdict, expect: str) -> None:
    assert verdict.code == expect, verdict
    assert verdict.allowed is expect.startswith("allow_"), verdict
    assert verdict.reason


@pytest.mark.parametrize(
    "case", IPC["cases"], ids=lambda c: f"{c['ip']}:{c['port']}->{c['expect']}"
)
def test_ip_classification(case: dict[str, Any]) -> None:
    _check(SMOKESCREEN.classify(case["ip"], case["port"]), case["expect"])


# smokescreen TestUnsafeAllowPrivateRanges: deny_ranges 192.168.0.0/24, 10.0.0.0/8.
# Modelled as AddressPolicy(unsafe_allow_private_ranges=True): RFC 1918/ULA open unless
# denied; CGNAT, loopback, link-local/metadata and the other special ranges stay denied.
BLOCKLIST = AddressPolicy(
    deny_cidrs=["192.168.0.0/24", "10.0.0.0/8"], unsafe_allow_private_ranges=True
)


@pytest.mark.parametrize(
    "case", IPC["unsafe_allow_private_ranges_mode"], ids=lambda c: f"{c['ip']}->{c['expect']}"
)
def test_unsafe_allow_private_ranges_mode(case: dict[str, Any]) -> None:
    _check(BLOCKLIST.classify(case["ip"], 443), case["expect"])


@pytest.mark.parametrize("case", IPC["precedence_gap"], ids=lambda c: str(c["ip"]))
def test_precedence_gap(case: dict[str, Any]) -> None:
    verdict = _policy(case["config"]).classify(case["ip"], 443)
    assert verdict.allowed is (case["want"] == "allow"), verdict
    assert verdict.code == "deny_user_configured"


DEFAULT = AddressPolicy()


@pytest.mark.parametrize("ip", IPC["codex_non_public"]["deny"])
def test_codex_non_public_denied(ip: str) -> None:
    verdict = DEFAULT.classify(ip, 443)
    assert not verdict.allowed, verdict
    assert ip in verdict.reason


@pytest.mark.parametrize("ip", IPC["codex_non_public"]["allow"])
def test_codex_public_allowed(ip: str) -> None:
    assert DEFAULT.classify(ip, 443).allowed


@pytest.mark.parametrize("case", DATA["authority_parsing"], ids=lambda c: c["input"])
def test_authority_parsing(case: dict[str, Any]) -> None:
    default_port = {"https": 443, "http": 80}.get(case.get("scheme", ""))
    if "error" in case:
        with pytest.raises(DestinationError, match=case["error"]):
            parse_authority(case["input"], default_port)
        return
    host, port = parse_authority(case["input"], default_port)
    assert port == case["port"]
    if "host_fqdn" in case:
        assert host.rstrip(".") + "." == case["host_fqdn"]
    else:
        assert host == case["host"]
