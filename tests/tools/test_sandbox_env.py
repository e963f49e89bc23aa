"""The sandbox environment: proxy URL with sandbox id and token, CA bundle, API-key variables."""

from __future__ import annotations

import base64
import fnmatch
import io
import json
import subprocess
import tomllib
import zipfile
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml

from gateway.core.policy.hosts import compile_host_pattern
from gateway.tools.sandbox_env import (
    API_KEY_VARIABLES,
    CA_VARIABLES,
    InvalidToken,
    check_token,
    dns_note,
    implicit_unbound,
    jvm_agent_bytes,
    node_preload_source,
    placeholders_of,
    proxy_url,
    render,
    sandbox_env,
    sandbox_variables,
)

ROOT = Path(__file__).resolve().parents[2]
JWT = "eyJhbGciOiJFZERTQSJ9." + base64.urlsafe_b64encode(
    json.dumps({"sub": "sb-42", "pol": "agent"}).encode()).rstrip(b"=").decode() + ".c2ln"


@pytest.mark.parametrize(
    ("proxy", "sandbox", "token", "expected"),
    [
        ("http://gateway:8080", "sb", "T", "http://sb:T@gateway:8080"),
        ("gateway:8080", "sb", "T", "http://sb:T@gateway:8080"),
        ("http://gateway", "sb", "T", "http://sb:T@gateway"),
        ("http://gateway:8080/", "sb", "T", "http://sb:T@gateway:8080"),
        ("http://Gateway.NS.svc:3128", "sb", "T", "http://sb:T@gateway.ns.svc:3128"),
        ("http://[fd00::1]:8080", "sb", "T", "http://sb:T@[fd00::1]:8080"),
        ("https://gateway:8443", "sb", "T", "https://sb:T@gateway:8443"),
        ("http://old:creds@gateway:8080", "sb", "T", "http://sb:T@gateway:8080"),
        ("http://gateway:8080", "a b", "t/k:n@", "http://a%20b:t%2Fk%3An%40@gateway:8080"),
        ("http://gateway:8080", "sb", "aaa.bb-b_.c~c", "http://sb:aaa.bb-b_.c~c@gateway:8080"),
    ],
)
def test_proxy_url(proxy: str, sandbox: str, token: str, expected: str) -> None:
    url = proxy_url(proxy, sandbox, token)
    assert url == expected
    parts = urlsplit(url)
    assert (unquote(parts.username or ""), unquote(parts.password or "")) == (sandbox, token)


def _env(lines: list[str]) -> dict[str, str]:
    env = dict(line.split("=", 1) for line in lines)
    assert len(env) == len(lines)  # no variable twice
    return env


def test_sandbox_env_contract() -> None:
    env = _env(sandbox_env(JWT, "http://gateway:8080"))
    url = f"http://sb-42:{JWT}@gateway:8080"
    assert env["HTTPS_PROXY"] == env["HTTP_PROXY"] == url
    assert env["https_proxy"] == env["http_proxy"] == url
    for var in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", *CA_VARIABLES):
        assert env[var] == "/etc/sandbox-gateway/ca-bundle.pem"
    for var in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", *API_KEY_VARIABLES):
        assert env[var] == JWT  # the token, never a key
    assert "localhost" in env["NO_PROXY"]
    # What particular tools need besides the common variables:
    for var in ("NPM_CONFIG_CAFILE", "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"):
        assert env[var] == "/etc/sandbox-gateway/ca-bundle.pem"
    assert env["GIT_HTTP_PROXY_AUTHMETHOD"] == "basic"
    assert env["NODE_USE_ENV_PROXY"] == "1"
    assert env["NODE_OPTIONS"] == "--import=/etc/sandbox-gateway/node-proxy-preload.mjs"


@pytest.mark.parametrize(("preload", "expected"), [
    (None, None),
    ("/opt/p.mjs", "--import=/opt/p.mjs"),
    ("/opt/my dir/p.mjs", '--import="/opt/my dir/p.mjs"'),
])
def test_node_options(preload: str | None, expected: str | None) -> None:
    env = dict(sandbox_variables("T", "gw:8080", node_preload=preload))
    assert env.get("NODE_OPTIONS") == expected
    assert env["NODE_USE_ENV_PROXY"] == "1"


@pytest.mark.parametrize(("agent", "expected"), [
    (None, None),
    ("/etc/sandbox-gateway/jvm-proxy-agent.jar",
     "-javaagent:/etc/sandbox-gateway/jvm-proxy-agent.jar"),
    ("/opt/my dir/a.jar", '-javaagent:"/opt/my dir/a.jar"'),
])
def test_java_tool_options(agent: str | None, expected: str | None) -> None:
    """The JVM agent on JAVA_TOOL_OPTIONS, and nothing else there: the JVM echoes it to
    stderr, so no token (the agent reads HTTPS_PROXY itself)."""
    env = dict(sandbox_variables("T0KEN", "gw:8080", jvm_agent=agent))
    assert env.get("JAVA_TOOL_OPTIONS") == expected
    assert "T0KEN" not in env.get("JAVA_TOOL_OPTIONS", "")


VARIABLES = [("HTTPS_PROXY", "http://s:a.b-c@gw:8080"), ("QUOTE", "it's \\ $HOME `x`"),
             ("NODE_OPTIONS", '--import="/a b/p.mjs"')]


def test_render_dotenv_is_literal() -> None:
    text = render(VARIABLES, "dotenv")
    assert text.splitlines() == [f"{k}={v}" for k, v in VARIABLES]
    with pytest.raises(ValueError, match="newline"):
        render([("K", "a\nb")], "dotenv")


def test_render_shell_round_trips_through_a_real_shell(tmp_path: Path) -> None:
    script = tmp_path / "env.sh"
    script.write_text(render(VARIABLES, "shell"))
    assert all(line.startswith("export ") for line in script.read_text().splitlines())
    code = ". ./env.sh; " + "; ".join(f'printf "%s\\0" "${k}"' for k, _ in VARIABLES)
    out = subprocess.run(["sh", "-c", code], cwd=tmp_path, capture_output=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"})
    assert out.stdout.decode().split("\0")[:-1] == [v for _, v in VARIABLES]


def test_render_k8s_is_a_container_env_list() -> None:
    doc = yaml.safe_load(render(VARIABLES, "k8s"))
    assert doc == {"env": [{"name": k, "value": v} for k, v in VARIABLES]}
    with pytest.raises(ValueError, match="unknown format"):
        render(VARIABLES, "json")


def _jwt(header: dict[str, object], claims: dict[str, object]) -> str:
    def enc(obj: dict[str, object]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()
    return f"{enc(header)}.{enc(claims)}.c2ln"


GOOD_HEADER = {"alg": "EdDSA", "kid": "k1", "typ": "JWT"}
GOOD = {"aud": "sandbox-gateway", "sub": "sb", "pol": "agent", "exp": 2_000_000_000,
        "jti": "j"}


@pytest.mark.parametrize(("token", "message"), [
    ("garbage", "not a JWT"),
    ("a.b", "not a JWT"),
    ("a..c", "not a JWT"),
    (_jwt(GOOD_HEADER, GOOD) + "\n", "not a JWT"),
    (_jwt(GOOD_HEADER, GOOD).replace("c2ln", "c2 ln"), "not a JWT"),
    ("e3.e30.c2ln", "header is not base64url-encoded JSON"),
    (_jwt(GOOD_HEADER, GOOD), ""),  # a well-formed, live token passes
    ("e30.W10.c2ln", "payload is not a JSON object"),
    (_jwt({"alg": "none"}, GOOD), "expected EdDSA"),
    (_jwt({"alg": "HS256", "kid": "k1"}, GOOD), "expected EdDSA"),
    (_jwt(GOOD_HEADER, {**GOOD, "aud": "other"}), "audience"),
    (_jwt(GOOD_HEADER, {k: v for k, v in GOOD.items() if k != "pol"}), "lacks the claims pol"),
    (_jwt(GOOD_HEADER, {**GOOD, "exp": "soon"}), "exp claim is not a number"),
    (_jwt(GOOD_HEADER, {**GOOD, "exp": 1_000}), "expired at 1970-01-01T00:16:40Z"),
])
def test_check_token_refuses(token: str, message: str) -> None:
    if not message:
        assert check_token(token, now=1_900_000_000)["sub"] == "sb"
        return
    with pytest.raises(InvalidToken, match=message):
        check_token(token, now=1_900_000_000)


def test_jvm_agent_is_package_data() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["gateway"]
    assert any(fnmatch.fnmatch("sandbox/jvm-proxy-agent.jar", g) for g in globs)
    assert jvm_agent_bytes() == (ROOT / "gateway" / "sandbox" / "jvm-proxy-agent.jar").read_bytes()
    with zipfile.ZipFile(io.BytesIO(jvm_agent_bytes())) as jar:
        manifest = jar.read("META-INF/MANIFEST.MF").decode()
    assert "Premain-Class: io.sandboxgateway.GatewayProxyAgent" in manifest


def test_node_preload_is_package_data() -> None:
    """The preload ships in the wheel: pyproject's package-data names it."""
    source = node_preload_source()
    assert "EnvHttpProxyAgent" in source and "CONNECT" in source
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["gateway"]
    assert any(fnmatch.fnmatch("sandbox/node-proxy-preload.mjs", g) for g in globs)
    assert (ROOT / "gateway" / "sandbox" / "node-proxy-preload.mjs").read_text() == source


@pytest.mark.parametrize(
    ("token", "sandbox", "expected"),
    [
        (JWT, None, "sb-42"),            # from the token's sub
        (JWT, "explicit", "explicit"),   # --sandbox wins
        ("opaque", None, "sandbox"),     # not a JWT: a placeholder user
        ("a.MTIz.b", None, "sandbox"),   # a JWT-looking token whose payload is not an object
    ],
)
def test_sandbox_id(token: str, sandbox: str | None, expected: str) -> None:
    env = _env(sandbox_env(token, "gateway:8080", sandbox=sandbox))
    assert urlsplit(env["HTTPS_PROXY"]).username == expected


def test_ca_bundle_path() -> None:
    env = _env(sandbox_env("T", "gateway:8080", ca_bundle="/opt/ca.pem"))
    assert {env[v] for v in CA_VARIABLES} == {"/opt/ca.pem"}


@pytest.mark.parametrize(
    ("proxy", "name_hint"),
    [("http://gateway.egress.svc:8080", True), ("http://10.96.0.20:8080", False),
     ("http://[fd00::20]:8080", False), ("gateway:3128", True)],
)
def test_dns_note_says_no_resolver_is_needed(proxy: str, name_hint: bool) -> None:
    note = "\n".join(dns_note(proxy))
    assert all(line.startswith("# ") for line in dns_note(proxy))  # comments, if pasted
    assert "needs no resolver" in note and "dnsPolicy: None" in note
    assert ("is a name" in note) is name_hint
    if name_hint:
        assert "hostAliases" in note


def test_placeholders_go_before_the_token_in_their_presets_variables() -> None:
    prefixes = placeholders_of([("anthropic", "sk-ant-api03-"), ("openai", None),
                                (None, "xoxb-")])  # (no preset: no variable to put it in)
    assert prefixes == {"ANTHROPIC_API_KEY": "sk-ant-api03-"}
    env = _env([f"{k}={v}" for k, v in sandbox_variables(JWT, "http://gateway:8080",
                                                         placeholders=prefixes)])
    assert env["ANTHROPIC_API_KEY"] == f"sk-ant-api03-{JWT}"
    assert env["OPENAI_API_KEY"] == JWT
    with pytest.raises(ValueError, match="different placeholders"):
        placeholders_of([("openai", "sk-proj-"), ("openai", "sk-")])


@pytest.mark.parametrize(
    ("credential_hosts", "git_hosts", "left_out"),
    [
        ([], (), ("HF_TOKEN", "GH_TOKEN", "GITHUB_TOKEN")),       # keyless: none of them
        (["api.openai.com"], ("github.com",), ("HF_TOKEN", "GH_TOKEN", "GITHUB_TOKEN")),
        (["huggingface.co"], (), ("GH_TOKEN", "GITHUB_TOKEN")),
        (["*.huggingface.co"], (), ("HF_TOKEN", "GH_TOKEN", "GITHUB_TOKEN")),  # not the apex
        (["api.github.com"], (), ("HF_TOKEN",)),                 # gh's API
        (["github.com"], (), ("HF_TOKEN",)),                     # git's paths only
        (["*.github.com"], (), ("HF_TOKEN",)),
        (["git.example.com"], ("git.example.com",), ("HF_TOKEN",)),  # the helper's host
        (["git.example.com"], (), ("HF_TOKEN", "GH_TOKEN", "GITHUB_TOKEN")),
        (["cdn-lfs.hf.co"], (), ("HF_TOKEN", "GH_TOKEN", "GITHUB_TOKEN")),  # a CDN is not the Hub
    ],
)
def test_variables_a_client_sends_unprompted_are_left_out_where_no_credential_binds(
        credential_hosts: list[str], git_hosts: tuple[str, ...],
        left_out: tuple[str, ...]) -> None:
    """huggingface_hub sends HF_TOKEN, gh GH_TOKEN/GITHUB_TOKEN, on every call to their
    vendor's hosts: holding the gateway token where no credential takes its place, the
    call is refused exfiltration_blocked, so env leaves the variable out."""
    omit = implicit_unbound([compile_host_pattern(h) for h in credential_hosts], git_hosts)
    assert omit == left_out
    env = _env([f"{k}={v}" for k, v in sandbox_variables(JWT, "http://gateway:8080",
                                                         omit=omit)])
    assert not set(left_out) & set(env)
    assert all(env[var] == JWT for var in API_KEY_VARIABLES if var not in left_out)
