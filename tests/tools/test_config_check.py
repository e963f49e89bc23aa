"""`network.allow_cidrs` warnings and `config check`: each warning's claim is checked
against the destination check itself (`AddressPolicy`), so a warning cannot lie."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.config import ConfigError, load_config, reach
from gateway.core.addresses import AddressPolicy
from gateway.tools.config_check import allow_cidr_warnings, listen_warnings

# (entry, warning fragment or None, addresses that stay denied, addresses it opens)
CASES = [
    ("0.0.0.0/0", "covers all of IPv4 but opens nothing",
     ["10.0.0.1", "127.0.0.1", "100.64.0.1", "169.254.169.254", "192.168.1.1"], []),
    ("::/0", "covers all of IPv6 but opens nothing", ["fd00::1", "::1", "fe80::1"], []),
    ("169.254.0.0/16", "opens nothing: it is inside 169.254.0.0/16 (link-local, incl. cloud "
     "metadata 169.254.169.254), which is hard-denied", ["169.254.169.254", "169.254.1.1"], []),
    ("169.254.169.254/32", "is hard-denied", ["169.254.169.254"], []),
    ("0.0.0.0/1", "contains 10.0.0.0/8 (private), which stays denied",
     ["10.0.0.1", "0.0.0.1", "100.100.100.200"], []),
    ("10.0.0.0/8", "opens a large private range (a /8)", [], ["10.1.2.3"]),
    ("10.0.0.0/12", "opens a large private range (a /12)", [], ["10.1.2.3"]),
    ("192.168.0.0/16", "opens a large private range (a /16)", [], ["192.168.4.4"]),
    ("100.64.0.0/10", "opens a large carrier-grade NAT range", [], ["100.64.1.1"]),
    ("fc00::/7", "opens a large unique-local range (a /7)", [], ["fd12::1"]),
    ("127.0.0.1/32", "opens loopback on the gateway host", [], ["127.0.0.1"]),
    ("10.20.0.0/16", None, [], ["10.20.1.1"]),
    ("fd12:3456:789a::/48", None, [], ["fd12:3456:789a::1"]),
    ("8.8.8.0/24", None, [], ["8.8.8.8"]),
]


@pytest.mark.parametrize(("entry", "fragment", "denied", "opened"), CASES,
                         ids=[c[0] for c in CASES])
def test_allow_cidr_warnings_tell_the_truth(entry: str, fragment: str | None,
                                            denied: list[str], opened: list[str]) -> None:
    warnings = allow_cidr_warnings([entry])
    if fragment is None:
        assert warnings == []
    else:
        assert any(fragment in w for w in warnings), warnings
        assert all(w.startswith(f"network.allow_cidrs: {entry} ") for w in warnings)
    policy = AddressPolicy(allow_cidrs=[entry])
    for ip in denied:
        assert not policy.classify(ip, 443).allowed, ip
    for ip in opened:
        assert policy.classify(ip, 443).allowed, ip
        assert not AddressPolicy().classify(ip, 443).allowed or ip == "8.8.8.8"


def test_invalid_cidr_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"'10\.0\.0\.0/33' is not a CIDR"):
        allow_cidr_warnings(["10.0.0.0/33"])


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in [v for v in os.environ if v.startswith("SANDBOX_GATEWAY_")]:
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "a.yaml").write_text("version: v1\nname: a\negress:\n"
                                                  "  - host: pypi.org\n")
    return tmp_path


def test_config_check(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (workdir / "gw.yaml").write_text("network: {allow_cidrs: [0.0.0.0/0, 10.20.0.0/16]}\n")
    assert main(["config", "check", "--config", "gw.yaml"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("config: gw.yaml\n")
    assert f"policies  {workdir / 'policies'}: 1 policies, 1 rules" in out
    assert "signing   " in out and "no key (created at the first start)" in out
    assert "warning: network.allow_cidrs: 0.0.0.0/0 covers all of IPv4" in out
    assert "warning: listen.proxy 0.0.0.0:8080 listens on every interface" in out  # (default)
    assert out.rstrip().endswith("OK (2 warning(s))")
    assert not (workdir / "certs").exists(), "config check creates nothing"


def test_config_check_fails_on_bad_policies_or_cidrs(
        workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (workdir / "policies" / "b.yaml").write_text("version: v1\nname: b\negress:\n"
                                                 "  - {host: x.example.com, methods: [GTE]}\n")
    assert main(["config", "check"]) == 1
    assert "1 error(s) (see `policy check`)" in capsys.readouterr().out
    (workdir / "gw.yaml").write_text("network: {allow_cidrs: [nonsense]}\n")
    assert main(["config", "check", "--config", "gw.yaml"]) == 1
    assert "'nonsense' is not a CIDR" in capsys.readouterr().err


def test_policy_check_suggests_the_method(workdir: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    (workdir / "policies" / "b.yaml").write_text("version: v1\nname: b\negress:\n"
                                                 "  - {host: x.example.com, methods: [GTE]}\n")
    assert main(["policy", "check"]) == 1
    err = capsys.readouterr().err
    assert 'policies/b.yaml:4: unknown method "GTE"; did you mean GET?' in err
    assert f"1 error(s) in {workdir / 'policies'}" in err


def test_a_spill_journal_on_the_audit_files_disk_is_a_warning(
        workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 46, item 5: the journal on the audit file's own disk takes nothing when that
    disk fills. The default (next to the state file) on the same disk is warned about;
    on another file system (/dev/shm, a tmpfs), or with audit lines on stdout, it is not."""
    (workdir / "gw.yaml").write_text("audit: {path: audit/audit.jsonl}\n")
    assert main(["config", "check", "--config", "gw.yaml"]) == 0
    out = capsys.readouterr().out
    assert f"warning: audit.spill.path ({workdir / 'state' / 'audit-spill'}) is on the " \
        f"file system of audit.path ({workdir / 'audit' / 'audit.jsonl'})" in out
    if os.stat("/dev/shm").st_dev != os.stat(workdir).st_dev:
        (workdir / "gw.yaml").write_text("audit: {path: audit/audit.jsonl, spill: "
                                         "{path: /dev/shm/sg-spill-test}}\n")
        assert main(["config", "check", "--config", "gw.yaml"]) == 0
        assert "audit.spill.path" not in capsys.readouterr().out
    (workdir / "gw.yaml").write_text("audit: {path: null}\n")
    assert main(["config", "check", "--config", "gw.yaml"]) == 0
    assert "audit.spill.path" not in capsys.readouterr().out


# (listen.proxy, listen.reachable_from, warned, what the banner says of it)
LISTEN = [
    ("0.0.0.0:8080", None, True, "reachable from other hosts: listening on every interface"),
    ("[::]:8080", None, True, "reachable from other hosts: listening on every interface"),
    (":8080", None, True, "reachable from other hosts: listening on every interface"),
    ("0.0.0.0:8080", "NetworkPolicy sandbox-gateway: sandbox pods only", False,
     "reachable from other hosts: listening on every interface; limited by: NetworkPolicy "
     "sandbox-gateway: sandbox pods only"),
    ("127.0.0.1:8080", None, False, "this host only: loopback"),
    ("[::1]:8080", None, False, "this host only: loopback"),
    ("localhost:8080", None, False, "this host only: loopback"),
    ("10.0.0.5:8080", None, False, "reachable from other hosts on 10.0.0.5's network"),
]


@pytest.mark.parametrize(("proxy", "stated", "warned", "said"), LISTEN,
                         ids=[f"{c[0]}-{'stated' if c[1] else 'unstated'}" for c in LISTEN])
def test_a_proxy_on_every_interface_is_warned_about_until_its_limits_are_stated(
        proxy: str, stated: str | None, warned: bool, said: str) -> None:
    """Issue 42, item 4: `config check` (and the start log) warns about a proxy on every
    interface unless `listen.reachable_from` says what limits who reaches it; the banner
    says whether the proxy is reachable from other hosts (`reach`)."""
    env = {"SANDBOX_GATEWAY_LISTEN__PROXY": proxy}
    if stated is not None:
        env["SANDBOX_GATEWAY_LISTEN__REACHABLE_FROM"] = stated
    cfg = load_config(None, env=env)
    warnings = listen_warnings(cfg)
    assert bool(warnings) == warned, warnings
    if warned:
        assert warnings[0].startswith(f"listen.proxy {cfg.listen.proxy} listens on every "
                                      "interface")
        assert "listen.reachable_from" in warnings[0] and "127.0.0.1:8080" in warnings[0]
    assert reach(cfg.listen.proxy.host, cfg.listen.reachable_from) == said


def test_learn_for_every_policy_is_a_warning() -> None:
    from gateway.tools.config_check import learn_warnings

    assert learn_warnings(load_config(None, env={})) == []
    (warning,) = learn_warnings(load_config(None, env={"SANDBOX_GATEWAY_LEARN": "true"}))
    assert warning.startswith("learn is true: every policy is in mode: learn")
