"""The operator CLI, run in-process (`gateway.cli.main`) in a temporary working directory."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import main
from gateway.net import ca
from gateway.services.identity.signing_keys import SigningKeys
from gateway.services.identity.tokens import TokenRefused, TokenService
from gateway.services.state.base import MemoryState

ROOT = Path(__file__).resolve().parents[2]

AGENT = """\
version: v1
name: agent
extends: [base]
egress:
  - host: api.openai.com
    credential: openai
    paths: ["/v1/chat/completions", "/v1/responses"]
  - host: api.anthropic.com
    credential: anthropic
credentials:
  openai: {preset: openai, secret: openai-api-key}
  anthropic: {preset: anthropic, secret: anthropic-api-key}
"""

BASE = """\
version: v1
name: base
egress:
  - host: pypi.org
"""


class Cli:
    def __init__(self, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
        self.root = root
        self.capsys = capsys

    def __call__(self, *argv: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        code = main(list(argv))
        out, err = self.capsys.readouterr()
        return code, out, err

    def service(self, signing: Path | None = None) -> TokenService:
        keys = SigningKeys.load(signing or self.root / "certs" / "signing", create=False)
        known = {"agent": ["anthropic", "openai"], "base": [], "long": []}
        return TokenService(keys, MemoryState(), known.get)


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> Cli:
    for var in [v for v in os.environ if v.startswith("SANDBOX_GATEWAY_")]:
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "agent.yaml").write_text(AGENT)
    (tmp_path / "policies" / "base.yaml").write_text(BASE)
    SigningKeys.load(tmp_path / "certs" / "signing")  # what the gateway's first start makes
    return Cli(tmp_path, capsys)


def claims(token: str) -> dict[str, Any]:
    import base64

    payload = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))


# --- policy check / explain ------------------------------------------------------------


def test_policy_check_good(cli: Cli) -> None:
    code, out, err = cli("policy", "check")
    assert code == 0, err
    assert "2 policies" in out and "OK" in out
    code, out, _ = cli("policy", "check", "policies")
    assert code == 0 and out.startswith("policies: 2 policies")


def test_policy_check_bad(cli: Cli, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.yaml").write_text(textwrap.dedent("""\
        version: v1
        name: a
        egress:
          - host: example.com
            prots: [443]
          - host: "*"
        """))
    (bad / "b.yaml").write_text("version: v2\nname: b\n")
    code, out, err = cli("policy", "check", str(bad))
    assert code == 1
    assert out == ""
    lines = err.strip().splitlines()
    problems = lines[:-1]
    assert len(problems) >= 3
    for line in problems:
        assert re.match(r"^.+/[ab]\.yaml:\d+: \S", line), line
    # Named relative to the directory (bad/a.yaml), which the last line names in full.
    assert any(line.startswith("bad/a.yaml:5: ") and "prots" in line for line in problems)
    assert re.match(rf"^{len(problems)} error\(s\) in {re.escape(str(bad))}$", lines[-1])


def test_policy_check_reads_telemetry_content(cli: Cli, tmp_path: Path) -> None:
    """`telemetry: {content: true}` passes `policy check`; a value that is not a boolean,
    or another key, is a problem with its line."""
    good = tmp_path / "good"
    good.mkdir()
    (good / "a.yaml").write_text("version: v1\nname: a\ntelemetry: {content: true}\n")
    assert cli("policy", "check", str(good))[0] == 0
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.yaml").write_text("version: v1\nname: a\ntelemetry:\n  content: always\n"
                                "  prompts: true\n")
    code, out, err = cli("policy", "check", str(bad))
    assert code == 1 and out == ""
    assert err.splitlines()[:2] == [
        "bad/a.yaml:4: telemetry.content must be true or false",
        'bad/a.yaml:5: unknown key "prompts" in telemetry; known keys: content']


def test_policy_check_empty_or_missing_dir(cli: Cli, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for directory in ("empty", "nope"):
        code, _, err = cli("policy", "check", directory)
        assert code == 1
        assert re.match(rf"^{directory}:0: ", err)


EXPLAIN = [
    ("GET", "https://api.openai.com/v1/chat/completions", 0, "allow", "credential openai"),
    ("POST", "api.anthropic.com/v1/messages", 0, "allow", "credential anthropic"),
    ("GET", "https://pypi.org/simple/", 0, "allow", None),     # inherited from base
    ("GET", "https://api.openai.com/v1/files", 1, "deny", None),
    ("GET", "https://evil.example/", 1, "deny", None),
    ("GET", "https://pypi.org:8443/", 1, "deny", None),
]


@pytest.mark.parametrize(("method", "url", "code", "decision", "inject"), EXPLAIN)
def test_policy_explain(cli: Cli, method: str, url: str, code: int, decision: str,
                        inject: str | None) -> None:
    rc, out, err = cli("policy", "explain", "--policy", "agent", method, url)
    assert rc == code, err
    lines = out.splitlines()
    assert lines[0] == f"decision: {decision}"
    assert lines[1].startswith("reason:   ") and len(lines[1]) > 12
    assert lines[2].startswith("rule:     ")
    if decision == "allow":
        assert re.match(r"rule:     .+\.yaml:\d+ \(host: ", lines[2])
    if inject:
        assert lines[3] == f"inject:   {inject}"
    else:
        assert not any(line.startswith("inject:") for line in lines)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "nope", "GET", "https://pypi.org/"], "unknown policy 'nope'"),
        (["--policy", "agent", "GET", "ftp://pypi.org/"], "unsupported URL scheme"),
        (["--policy", "agent", "GET", "https://pypi.org:99999/"], "invalid URL"),
    ],
)
def test_policy_explain_bad_input(cli: Cli, argv: list[str], message: str) -> None:
    code, out, err = cli("policy", "explain", *argv)
    assert out == ""
    assert code == 2  # neither allow (0) nor deny (1): the question itself is wrong
    assert message in err
    assert "Traceback" not in err


def test_policy_explain_dir(cli: Cli, tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.yaml").write_text("version: v1\nname: x\negress:\n"
                                               "  - host: x.example\n")
    code, out, _ = cli("policy", "explain", "--dir", "other", "--policy", "x", "GET",
                       "https://x.example/")
    assert code == 0 and out.startswith("decision: allow")


MCP_POLICY = """version: v1
name: m
egress:
  - host: mcp.example
    mcp:
      tools: {allow: ["search_*"], deny: ["delete_*"]}
      resources: {allow: ["repo://org/*"]}
      arguments: {search_issues: {repo: "org/*"}}
"""


@pytest.mark.parametrize(("argv", "code", "phrase"), [
    (["--mcp", "tools/call:search_x"], 0, "decision: allow"),
    (["--mcp", "tools/call:delete_x"], 1, "denied by the rule's pattern 'delete_*'"),
    (["--mcp", "tools/call:search_issues", "--mcp-arguments", '{"repo": "evil/x"}'], 1,
     "does not match 'org/*'"),
    (["--mcp", "resources/read:secret://k"], 1, "not in the rule's mcp.resources.allow"),
    (["--mcp", "tools/list"], 0, "decision: allow"),
    (["--mcp", "sampling/createMessage"], 1, "is not one an mcp rule lets through"),
    (["--body", "[1]"], 1, "not MCP JSON-RPC"),
    ([], 0, "mcp:      the calls are not checked"),
])
def test_policy_explain_mcp(cli: Cli, tmp_path: Path, argv: list[str], code: int,
                            phrase: str) -> None:
    """`explain` decides an MCP call as the proxy does (core/mcp.judge in the pipeline)."""
    (tmp_path / "mcp").mkdir()
    (tmp_path / "mcp" / "m.yaml").write_text(MCP_POLICY)
    got, out, err = cli("policy", "explain", "--dir", "mcp", "--policy", "m", *argv, "POST",
                        "https://mcp.example/mcp")
    assert (got, phrase in out) == (code, True), out + err


ASK_POLICY = """version: v1
name: a
ask: {hosts: true, timeout: 30s}
egress:
  - host: allowed.example
    methods: [GET]
  - host: asks.example
    ask: true
  - host: never.example
    action: deny
"""


@pytest.mark.parametrize(("method", "url", "code", "ask"), [
    ("GET", "https://new.example/", 1, "ask:      the proxy asks a person instead of refusing"
     ": ask (hosts; timeout 30s)"),
    ("GET", "https://asks.example/x", 0, "ask:      a person is asked first: ask (this rule"),
    ("POST", "https://allowed.example/", 1, None),  # (requests: not askable here)
    ("GET", "https://never.example/", 1, None),  # a deny rule is never asked
    ("GET", "https://allowed.example/", 0, None),
])
def test_policy_explain_says_what_a_person_may_decide(cli: Cli, tmp_path: Path, method: str,
                                                      url: str, code: int,
                                                      ask: str | None) -> None:
    """`explain` says where the proxy would ask a person (ask mode), as the gate decides
    it (core/evaluate.askable)."""
    (tmp_path / "ask").mkdir()
    (tmp_path / "ask" / "a.yaml").write_text(ASK_POLICY)
    got, out, err = cli("policy", "explain", "--dir", "ask", "--policy", "a", method, url)
    assert got == code, out + err
    asked = [line for line in out.splitlines() if line.startswith("ask:")]
    assert (asked[0].startswith(ask) if ask else asked == []), out


def _resolve_setup(tmp_path: Path, network: str) -> None:
    (tmp_path / "policies" / "ip.yaml").write_text(
        "version: v1\nname: ip\negress:\n  - host: 10.0.0.5\n  - host: api.internal.test\n")
    (tmp_path / "gateway.yaml").write_text(f"network:\n{textwrap.indent(network, '  ')}")


@pytest.mark.parametrize(("network", "url", "code", "lines"), [
    # an IP literal is checked as it is (no DNS): a private range is refused ...
    ("allow_cidrs: []\n", "https://10.0.0.5/", 1,
     ["decision: deny", "error:    forbidden_destination", "policy:   allow (",
      "destination: refused (forbidden_destination) [deny_private_range]; see reason"]),
    # ... unless network.allow_cidrs opens it
    ("allow_cidrs: [10.0.0.0/8]\n", "https://10.0.0.5/", 0,
     ["decision: allow", "destination: allowed: 10.0.0.5 -> 10.0.0.5 port 443: 10.0.0.5 is in "
      "10.0.0.0/8 (network.allow_cidrs) [allow_user_configured]"]),
    # network.resolve overrides are operator-trusted, except the hard ranges
    ("resolve: {api.internal.test: '127.0.0.1:9'}\n", "https://api.internal.test/", 0,
     ["decision: allow", "destination: allowed: api.internal.test -> 127.0.0.1 port 9: "
      "127.0.0.1 port 9 is an operator-trusted target (network.resolve) "
      "[allow_user_configured]"]),
    ("resolve: {api.internal.test: '169.254.169.254:80'}\n", "https://api.internal.test/", 1,
     ["decision: deny", "reason:   api.internal.test is mapped by network.resolve to "
      "169.254.169.254: 169.254.169.254 is a link-local (cloud metadata) address"]),
    # a policy denial is the answer: the host is not resolved at all
    ("allow_cidrs: []\n", "https://evil.test/", 1,
     ["decision: deny", "error:    policy_denied",
      "destination: not checked (the policy denies; the gateway does not resolve a denied "
      "host)"]),
])
def test_policy_explain_resolve(cli: Cli, tmp_path: Path, network: str, url: str, code: int,
                                lines: list[str]) -> None:
    _resolve_setup(tmp_path, network)
    rc, out, err = cli("policy", "explain", "--config", "gateway.yaml", "--resolve",
                       "--policy", "ip", "GET", url)
    assert rc == code, err
    for line in lines:
        assert any(got.startswith(line) for got in out.splitlines()), (line, out)


def test_policy_explain_without_resolve_ignores_destinations(cli: Cli, tmp_path: Path) -> None:
    _resolve_setup(tmp_path, "allow_cidrs: []\n")
    rc, out, _ = cli("policy", "explain", "--config", "gateway.yaml", "--policy", "ip", "GET",
                     "https://10.0.0.5/")
    assert rc == 0 and out.startswith("decision: allow") and "destination" not in out


# --- token mint / rotate ---------------------------------------------------------------


def test_token_mint_default_scope(cli: Cli) -> None:
    code, out, err = cli("token", "mint", "--sandbox", "sb-1", "--policy", "agent")
    assert code == 0, err
    token = out.strip()
    assert out.count("\n") == 1 and token.count(".") == 2
    identity = cli.service().verify(token)
    assert (identity.sandbox, identity.policy) == ("sb-1", "agent")
    assert identity.scope == {"openai": None, "anthropic": None}
    assert identity.expires_at - identity.issued_at == 15 * 60
    assert (cli.root / "certs" / "signing").is_dir()


def test_token_mint_scope_repeatable_and_ttl(cli: Cli) -> None:
    code, out, err = cli("token", "mint", "--sandbox", "sb-2", "--policy", "agent",
                         "--scope", "openai:/v1/responses", "--scope", "anthropic", "--ttl", "5m")
    assert code == 0, err
    identity = cli.service().verify(out.strip())
    assert identity.scope == {"openai": frozenset({"/v1/responses"}), "anthropic": None}
    assert identity.expires_at - identity.issued_at == 300


def test_token_mint_json(cli: Cli) -> None:
    code, out, _ = cli("token", "mint", "--sandbox", "sb-1", "--policy", "base", "--json")
    assert code == 0
    data = json.loads(out)
    assert set(data) == {"token", "jti", "expires_at"}
    assert claims(data["token"])["jti"] == data["jti"]
    assert claims(data["token"])["exp"] == data["expires_at"]
    assert claims(data["token"])["scope"] == ""
    cli.service().verify(data["token"])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--policy", "agent", "--ttl", "25h"], "longer than tokens.max_ttl"),
        (["--policy", "agent", "--ttl", "soon"], "--ttl: 'soon' is not a duration"),
        (["--policy", "nope"], "policy 'nope' does not exist"),
        (["--policy", "agent", "--scope", "openai:v1"], "must start with /"),
    ],
)
def test_token_mint_refused(cli: Cli, extra: list[str], message: str) -> None:
    code, out, err = cli("token", "mint", "--sandbox", "sb-1", *extra)
    assert code == 1
    assert out == ""
    assert err.startswith("sandbox-gateway: ") and message in err
    assert "Traceback" not in err


def test_token_mint_unknown_policy_lists_known(cli: Cli) -> None:
    _, _, err = cli("token", "mint", "--sandbox", "sb-1", "--policy", "nope")
    assert "known: agent, base" in err


@pytest.mark.parametrize("where", ["before", "after"])
def test_config_option_before_or_after_the_subcommand(cli: Cli, tmp_path: Path,
                                                      where: str) -> None:
    (tmp_path / "gw.yaml").write_text("tokens: {default_ttl: 10m, max_ttl: 1h}\n"
                                      "certs: other-certs\n")
    mint = ["token", "mint", "--sandbox", "sb", "--policy", "agent", "--ttl", "2h"]
    argv = ["--config", "gw.yaml", *mint] if where == "before" else [*mint, "--config", "gw.yaml"]
    code, _, err = cli(*argv)  # other-certs holds no key yet: refused, nothing created
    assert code == 1 and "no signing key in" in err and "config: gw.yaml" in err
    assert not (tmp_path / "other-certs").exists()
    code, _, err = cli(*argv, "--init")
    assert code == 1 and "longer than tokens.max_ttl (3600s)" in err
    argv = [a for a in argv if a not in ("--ttl", "2h")]
    code, out, _ = cli(*argv)
    assert code == 0
    service = cli.service(tmp_path / "other-certs" / "signing")
    identity = service.verify(out.strip())
    assert identity.expires_at - identity.issued_at == 600


def test_token_mint_never_creates_a_key_in_an_uninitialised_certs_dir(
        cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "policies").symlink_to(tmp_path / "policies")
    monkeypatch.chdir(elsewhere)
    code, out, err = cli("token", "mint", "--sandbox", "sb", "--policy", "agent")
    assert code == 1 and out == ""
    signing = elsewhere / "certs" / "signing"
    assert f"no signing key in {signing} (certs: {elsewhere / 'certs'}, config: <defaults>)" \
        in err
    assert "--config" in err and "--init" in err
    assert not (elsewhere / "certs").exists()
    code, _, err = cli("token", "rotate-key")
    assert code == 1 and "no signing key in" in err and not (elsewhere / "certs").exists()
    code, out, err = cli("token", "mint", "--sandbox", "sb", "--policy", "agent", "--init")
    assert code == 0, err
    assert len(list(signing.glob("*.pem"))) == 1
    cli.service(signing).verify(out.strip())


def test_token_mint_with_a_broken_key_file_says_which(cli: Cli) -> None:
    (cli.root / "certs" / "signing" / "k0.pem").write_text("not a key\n")
    code, _, err = cli("token", "mint", "--sandbox", "sb", "--policy", "agent", "--init")
    assert code == 1 and "k0.pem: not a readable PEM private key" in err
    assert "Traceback" not in err


def test_token_rotate_key(cli: Cli) -> None:
    _, first, _ = cli("token", "mint", "--sandbox", "sb", "--policy", "agent")
    code, out, _ = cli("token", "rotate-key")
    assert code == 0
    kid = re.search(r"new signing key (\S+) in ", out)
    assert kid is not None and "retire-key" in out
    assert "signs with it within 2 seconds (no restart)" in out
    signing = cli.root / "certs" / "signing"
    assert len(list(signing.glob("*.pem"))) == 2
    _, second, _ = cli("token", "mint", "--sandbox", "sb", "--policy", "agent")
    import jwt

    assert jwt.get_unverified_header(second.strip())["kid"] == kid.group(1)
    service = cli.service()
    service.verify(first.strip())    # old key still verifies
    service.verify(second.strip())


def test_token_retire_key(cli: Cli) -> None:
    import jwt

    _, first, _ = cli("token", "mint", "--sandbox", "sb", "--policy", "agent")
    old_kid = jwt.get_unverified_header(first.strip())["kid"]
    code, _, err = cli("token", "retire-key", old_kid)
    assert code == 1 and "is the signing key; run `token rotate-key` first" in err
    code, _, err = cli("token", "retire-key", "k-nope")
    assert code == 1 and "no key 'k-nope'" in err and old_kid in err
    cli("token", "rotate-key")
    code, out, err = cli("token", "retire-key", old_kid)
    assert code == 0, err
    signing = cli.root / "certs" / "signing"
    assert "within 2 seconds" in out and (signing / "retired" / f"{old_kid}.pem").is_file()
    assert not (signing / f"{old_kid}.pem").exists()
    with pytest.raises(TokenRefused) as info:
        cli.service().verify(first.strip())
    assert info.value.code == "token_unknown_key"


def test_token_retired_kid_from_config(cli: Cli, tmp_path: Path) -> None:
    _, old, _ = cli("token", "mint", "--sandbox", "sb", "--policy", "agent")
    import jwt

    old_kid = jwt.get_unverified_header(old.strip())["kid"]
    cli("token", "rotate-key")
    (tmp_path / "gw.yaml").write_text(f"tokens: {{retired_kids: [{old_kid}]}}\n")
    _, new, _ = cli("token", "mint", "--config", "gw.yaml", "--sandbox", "sb", "--policy",
                    "agent")
    assert jwt.get_unverified_header(new.strip())["kid"] != old_kid
    keys = SigningKeys.load(tmp_path / "certs" / "signing", retired=[old_kid])
    service = TokenService(keys, MemoryState(), {"agent": []}.get)
    with pytest.raises(TokenRefused) as info:
        service.verify(old.strip())
    assert info.value.code == "token_unknown_key"


# --- ca init ---------------------------------------------------------------------------


def test_ca_init(cli: Cli) -> None:
    code, out, _ = cli("ca", "init")
    assert code == 0
    certs = cli.root / "certs"
    assert (certs / ca.CA_CERT).is_file() and (certs / ca.CA_KEY).is_file()
    assert (certs / ca.CA_KEY).stat().st_mode & 0o777 == 0o600
    assert str(certs / ca.CA_CERT) in out
    before = (certs / ca.CA_KEY).read_bytes()

    code, out, err = cli("ca", "init")
    assert code == 1 and out == ""
    assert "already holds a CA" in err
    assert (certs / ca.CA_KEY).read_bytes() == before


def test_ca_init_dir_and_half_pair(cli: Cli) -> None:
    assert cli("ca", "init", "--dir", "elsewhere")[0] == 0
    assert (cli.root / "elsewhere" / ca.CA_CERT).is_file()
    (cli.root / "elsewhere" / ca.CA_CERT).unlink()
    code, _, err = cli("ca", "init", "--dir", "elsewhere")
    assert code == 1 and "already holds a CA" in err  # the key alone is never overwritten


# --- env -------------------------------------------------------------------------------


def test_env(cli: Cli) -> None:
    _, out, _ = cli("token", "mint", "--sandbox", "sb-7", "--policy", "agent")
    token = out.strip()
    code, out, err = cli("env", "--token", token, "--proxy", "http://gateway:8080")
    assert code == 0
    env = dict(line.split("=", 1) for line in out.splitlines())  # stdout: the env file only
    assert "needs no resolver" in err and "hostAliases" in err  # stderr: the DNS advice
    assert env["HTTPS_PROXY"] == f"http://sb-7:{token}@gateway:8080"
    assert env["HTTP_PROXY"] == env["HTTPS_PROXY"]
    for var in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS"):
        assert env[var] == "/etc/sandbox-gateway/ca-bundle.pem"
    assert env["OPENAI_API_KEY"] == token
    assert env["ANTHROPIC_API_KEY"] == token


def test_env_options(cli: Cli) -> None:
    _, out, _ = cli("token", "mint", "--sandbox", "sb-7", "--policy", "agent")
    token = out.strip()
    code, out, _ = cli("env", "--token", token, "--proxy", "gateway:3128", "--sandbox", "box",
                       "--ca-bundle", "/ca.pem", "--node-preload", "/opt/p.mjs")
    assert code == 0
    env = dict(line.split("=", 1) for line in out.splitlines())
    assert env["HTTPS_PROXY"] == f"http://box:{token}@gateway:3128"
    assert env["SSL_CERT_FILE"] == env["GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"] == "/ca.pem"
    assert env["NODE_OPTIONS"] == "--import=/opt/p.mjs"
    assert env["OPENAI_API_KEY"] == token
    code, out, _ = cli("env", "--token", token, "--proxy", "gw:1", "--node-preload", "none")
    assert code == 0 and "NODE_OPTIONS" not in out and "NODE_USE_ENV_PROXY=1" in out


def test_env_formats(cli: Cli) -> None:
    token = cli("token", "mint", "--sandbox", "sb-7", "--policy", "agent")[1].strip()
    outputs = {fmt: cli("env", "--token", token, "--proxy", "gw:8080", "--format", fmt)
               for fmt in ("dotenv", "shell", "k8s")}
    assert all(code == 0 for code, _, _ in outputs.values())
    dotenv = dict(line.split("=", 1) for line in outputs["dotenv"][1].splitlines())
    shell = subprocess.run(["sh", "-c", outputs["shell"][1] + "env"], capture_output=True,
                           text=True, check=True, env={"PATH": "/usr/bin:/bin"}).stdout
    for key, value in dotenv.items():
        assert f"{key}={value}\n" in shell
    k8s = yaml.safe_load(outputs["k8s"][1])["env"]
    assert [(e["name"], e["value"]) for e in k8s] == list(dotenv.items())


@pytest.mark.parametrize("token", ["garbage", "a.b.c", ""])
def test_env_refuses_a_token_that_is_no_gateway_token(cli: Cli, token: str) -> None:
    code, out, err = cli("env", "--token", token, "--proxy", "http://gateway:8080")
    assert code == 1 and out == ""
    assert "--token is not a usable gateway token" in err and "token mint" in err


def test_env_refuses_an_expired_token(cli: Cli) -> None:
    keys = SigningKeys.load(cli.root / "certs" / "signing")
    service = TokenService(keys, MemoryState(), {"agent": []}.get, clock=lambda: 1_000_000.0)
    token = service.mint("sb", "agent").token
    code, out, err = cli("env", "--token", token, "--proxy", "gw:8080")
    assert code == 1 and out == "" and "it expired at 1970-01-12" in err


def test_env_checks_the_signature_with_config(cli: Cli, tmp_path: Path) -> None:
    (tmp_path / "gw.yaml").write_text("policies: ./policies\ncerts: ./certs\n")
    good = cli("token", "mint", "--config", "gw.yaml", "--sandbox", "sb", "--policy",
               "agent")[1].strip()
    code, out, err = cli("env", "--config", "gw.yaml", "--token", good, "--proxy", "gw:8080")
    assert code == 0 and "HTTPS_PROXY=" in out and "signature was not checked" not in err
    # Signed by a key this gateway does not have: the structure is fine, the signature not.
    other = SigningKeys.load(tmp_path / "elsewhere")
    forged = TokenService(other, MemoryState(), {"agent": []}.get).mint("sb", "agent").token
    code, out, err = cli("env", "--config", "gw.yaml", "--token", forged, "--proxy", "gw:8080")
    assert code == 1 and out == "" and "token_unknown_key" in err
    # A policy the gateway does not have.
    stray = TokenService(SigningKeys.load(tmp_path / "certs" / "signing"), MemoryState(),
                         {"gone": []}.get).mint("sb", "gone").token
    code, _, err = cli("env", "--config", "gw.yaml", "--token", stray, "--proxy", "gw:8080")
    assert code == 1 and "unknown_policy" in err


def test_env_checks_the_signature_with_the_embedded_defaults(cli: Cli, tmp_path: Path) -> None:
    """Issue 42, item 6: without --config, `env` checks the token against the embedded
    defaults' keys and policies (./certs/signing, ./policies: what `make run` and `token
    mint` use) where they are; where they are not, it says it could not check."""
    good = cli("token", "mint", "--sandbox", "sb", "--policy", "agent")[1].strip()
    code, out, err = cli("env", "--token", good, "--proxy", "gw:8080")
    assert code == 0 and "HTTPS_PROXY=" in out and "signature was not checked" not in err
    other = SigningKeys.load(tmp_path / "elsewhere")
    forged = TokenService(other, MemoryState(), {"agent": []}.get).mint("sb", "agent").token
    code, out, err = cli("env", "--token", forged, "--proxy", "gw:8080")
    assert code == 1 and out == "" and "token_unknown_key" in err
    shutil.move(tmp_path / "certs", tmp_path / "moved-certs")  # no gateway files here
    code, out, err = cli("env", "--token", forged, "--proxy", "gw:8080")
    assert code == 0 and "HTTPS_PROXY=" in out
    assert (f"signature was not checked: no gateway signing keys in "
            f"{tmp_path / 'certs' / 'signing'}") in err and "pass --config" in err


def test_node_preload_verb(cli: Cli, tmp_path: Path) -> None:
    from gateway.tools.sandbox_env import node_preload_source

    code, out, _ = cli("node-preload")
    assert code == 0 and out == node_preload_source()
    code, _, err = cli("node-preload", "-o", "img/node-proxy-preload.mjs")
    assert code == 0 and "NODE_OPTIONS=--import=img/node-proxy-preload.mjs" in err
    assert (tmp_path / "img" / "node-proxy-preload.mjs").read_text() == node_preload_source()


# --- errors and the real entry point ---------------------------------------------------


def test_bad_config_is_reported(cli: Cli, tmp_path: Path) -> None:
    (tmp_path / "gw.yaml").write_text("tokens: {max_tl: 1h}\n")
    code, _, err = cli("policy", "check", "--config", "gw.yaml")
    assert code == 1
    assert "tokens.max_tl: unknown key; did you mean tokens.max_ttl?" in err


def test_usage_errors_exit_2(cli: Cli) -> None:
    with pytest.raises(SystemExit) as info:
        main(["token", "mint", "--policy", "agent"])
    assert info.value.code == 2


def test_python_dash_m_help() -> None:
    result = subprocess.run([sys.executable, "-m", "gateway", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: sandbox-gateway")
    for command in ("run", "token", "policy", "ca", "env", "node-preload"):
        assert command in result.stdout


# --- token lifetimes for long agent sessions ---------------------------------------------


def _long_policy(cli: Cli, ttl: str) -> None:
    (cli.root / "policies" / "long.yaml").write_text(
        f"version: v1\nname: long\nextends: [base]\ntokens: {{ttl: {ttl}}}\n")


def test_a_policy_chooses_its_tokens_lifetime(cli: Cli) -> None:
    """`tokens: {ttl: 8h}` on a policy: its tokens live 8 h unless the mint says otherwise;
    other policies keep tokens.default_ttl."""
    _long_policy(cli, "8h")
    for extra, lifetime in (([], 8 * 3600), (["--ttl", "20m"], 1200)):
        code, out, err = cli("token", "mint", "--sandbox", "sb", "--policy", "long", *extra)
        assert code == 0, err
        c = claims(out.strip())
        assert c["exp"] - c["iat"] == lifetime
    code, out, _ = cli("token", "mint", "--sandbox", "sb", "--policy", "agent")
    assert code == 0 and claims(out.strip())["exp"] - claims(out.strip())["iat"] == 900


def test_a_policy_lifetime_over_max_ttl_is_refused_at_mint(cli: Cli) -> None:
    _long_policy(cli, "2d")
    code, out, err = cli("token", "mint", "--sandbox", "sb", "--policy", "long")
    assert code == 1 and out == ""
    assert ("policy 'long' sets tokens: {ttl: 172800s}, which is longer than tokens.max_ttl "
            "(86400s); shorten it or raise the gateway's tokens.max_ttl") in err


def test_env_mints_the_token_with_a_lifetime(cli: Cli) -> None:
    """`env --policy P --sandbox S [--ttl 8h]`: one command for an agent session that
    reads its key once."""
    _long_policy(cli, "8h")
    for extra, lifetime in (([], 8 * 3600), (["--ttl", "2h"], 7200)):
        code, out, err = cli("env", "--policy", "long", "--sandbox", "agent-7", *extra,
                             "--proxy", "http://gw:8080")
        assert code == 0, err
        env = dict(line.split("=", 1) for line in out.splitlines())
        token = env["OPENAI_API_KEY"]
        assert env["HTTPS_PROXY"] == f"http://agent-7:{token}@gw:8080"
        c = claims(token)
        assert (c["sub"], c["pol"], c["exp"] - c["iat"]) == ("agent-7", "long", lifetime)
        assert f"# minted token {c['jti']} for sandbox agent-7, policy long" in err
        cli.service().verify(token)


@pytest.mark.parametrize(("argv", "message"), [
    (["--policy", "agent"], "env --policy needs --sandbox"),
    (["--policy", "agent", "--sandbox", "s", "--token", "x"], "env needs --token, or --policy"),
    ([], "env needs --token, or --policy"),
    (["--policy", "agent", "--sandbox", "s", "--ttl", "30h"], "longer than tokens.max_ttl"),
])
def test_env_mint_refusals(cli: Cli, argv: list[str], message: str) -> None:
    code, out, err = cli("env", *argv, "--proxy", "http://gw:8080")
    assert code != 0 and out == "" and message in err


def test_env_ttl_is_for_a_minted_token(cli: Cli) -> None:
    _, token, _ = cli("token", "mint", "--sandbox", "sb", "--policy", "agent")
    code, out, err = cli("env", "--token", token.strip(), "--ttl", "8h", "--proxy", "http://gw:8080")
    assert code == 2 and out == "" and "a given token keeps its own expiry" in err
