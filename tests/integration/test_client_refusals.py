"""What real clients show for a refusal, configured only by `sandbox-gateway env` output:
the official Python and Node `openai` / `anthropic` SDKs, requests, pip and curl, for a
refused CONNECT (a host no rule allows) and a refused request (a path no rule allows,
inside an allowed, intercepted tunnel). The agent must see the code and the reason (and,
where the client shows it, the hint not to retry around the gateway)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fakes.inference import FakeInference
from helpers.gateway import GatewayThread
from helpers.node_clients import node_clients
from helpers.sandbox import Sandbox

from gateway.cli import main as cli_main

KEY = "sk-refusal-provider-key-0123456789"
POLICY = """\
version: v1
name: agent
egress:
  - host: api.openai.com
    credential: openai
    paths: ["/v1/chat/completions"]
  - host: api.anthropic.com
    credential: anthropic
    paths: ["/v1/messages"]
  - host: tools.test
    methods: [GET]
    paths: ["/ok"]
credentials:
  openai: {preset: openai, secret: provider-key}
  anthropic: {preset: anthropic, secret: provider-key}
"""
CONNECT_REASON = 'no rule in policy "agent" allows host "evil.example"'
HINT = "retrying the same request another way"


def path_reason(path: str, host: str) -> tuple[str, str]:
    """Parts of the reason for a refused path (a JSON body escapes the quotes around it)."""
    return path, f" is not allowed for {host} by rule "


@dataclass
class Env:
    gw: GatewayThread
    box: Sandbox


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("refusals")
    with FakeInference(root / "fake", api_key=KEY) as fake:
        (root / "policies").mkdir()
        (root / "policies" / "agent.yaml").write_text(POLICY)
        secrets = root / "secrets.yaml"
        secrets.write_text(f"provider-key: {KEY}\n")
        secrets.chmod(0o600)
        names = ["api.openai.com", "api.anthropic.com", "tools.test"]
        gw = GatewayThread(root, {
            "network": {"upstream_ca": str(fake.ca_path),
                        "resolve": {n: f"127.0.0.1:{fake.port}" for n in names}},
            "secrets": {"store": "file", "path": str(secrets)}})
        try:
            preload = root / "node-proxy-preload.mjs"
            assert cli_main(["node-preload", "-o", str(preload)]) == 0
            box = Sandbox.from_cli(root / "home", token=gw.mint("agent", sandbox="agent-1"),
                                   proxy=gw.proxy, ca_bundle=gw.ca_cert, node_preload=preload,
                                   config=root / "gateway.yaml")
            yield Env(gw, box)
        finally:
            gw.stop()


def _shows(text: str, code: str, reason: str | tuple[str, ...], hint: bool = True) -> None:
    parts = (reason,) if isinstance(reason, str) else reason
    assert code in text and all(p in text for p in parts), text[-3000:]
    if hint:
        assert HINT in text, text[-3000:]


# --------------------------------------------------------------------------- Python SDKs

PY_SDK = """
import importlib, sys
which, where = sys.argv[1], sys.argv[2]
base = {"connect": "https://evil.example" + ("/v1" if which == "openai" else "")}.get(where)
sdk = importlib.import_module(which)
client = (sdk.OpenAI if which == "openai" else sdk.Anthropic)(max_retries=0, base_url=base)
try:
    client.models.list()
except Exception as exc:
    print("MESSAGE:", exc)
    raise
"""


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_python_sdk_refused_request(env: Env, sdk: str) -> None:
    out = env.box.run([sys.executable, "-c", PY_SDK, sdk, "request"], timeout=60)
    assert out.returncode == 1
    # The exception's own message carries the code, the reason and the hint
    # (the body is in the provider's error shape, which the SDK reads).
    message = out.stdout.partition("MESSAGE:")[2]
    assert "PermissionDeniedError" in out.stderr
    _shows(message, "policy_denied", path_reason("/v1/models", f"api.{sdk}.com"))


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_python_sdk_refused_connect(env: Env, sdk: str) -> None:
    out = env.box.run([sys.executable, "-c", PY_SDK, sdk, "connect"], timeout=60)
    assert out.returncode == 1
    # The SDK's message is a fixed "Connection error."; the refusal is in the exception it
    # chains (httpx.ProxyError: the status line), which the traceback shows.
    assert out.stdout.strip() == "MESSAGE: Connection error."
    assert "ProxyError: 403 policy_denied" in out.stderr
    _shows(out.stderr, "policy_denied", CONNECT_REASON)


# --------------------------------------------------------------------------- Node SDKs

NODE_SDK = """
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';
const [which, where] = process.argv.slice(2);
const opts = { maxRetries: 0 };
if (where === 'connect') opts.baseURL = 'https://evil.example' + (which === 'openai' ? '/v1' : '');
const client = which === 'openai' ? new OpenAI(opts) : new Anthropic(opts);
try {
  await client.models.list();
} catch (err) {
  console.log('MESSAGE:', err.message);
  throw err;  // uncaught: Node prints the error with its cause chain
}
"""


@pytest.fixture(scope="module")
def node_dir() -> Path:
    return node_clients()


def _node(env: Env, node_dir: Path, sdk: str, where: str) -> tuple[str, str]:
    script = node_dir / "refusal-sdk.mjs"
    script.write_text(NODE_SDK)
    out = env.box.run(["node", str(script), sdk, where], cwd=node_dir, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    return out.stdout.partition("MESSAGE:")[2], out.stderr


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_node_sdk_refused_request(env: Env, node_dir: Path, sdk: str) -> None:
    message, stderr = _node(env, node_dir, sdk, "request")
    assert "PermissionDeniedError" in stderr
    _shows(message, "policy_denied", path_reason("/v1/models", f"api.{sdk}.com"))


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_node_sdk_refused_connect(env: Env, node_dir: Path, sdk: str) -> None:
    message, stderr = _node(env, node_dir, sdk, "connect")
    # "Connection error." again; the preload's connector puts the proxy's status line
    # into the error the SDK chains as its cause, printed when uncaught.
    assert message.strip() == "Connection error."
    assert "proxy refused CONNECT evil.example:443: 403 policy_denied" in stderr
    _shows(stderr, "policy_denied", CONNECT_REASON)


# --------------------------------------------------------------------------- requests, pip, curl

REQUESTS = """
import sys, requests
try:
    r = requests.get(sys.argv[1], timeout=10)
    print("STATUS:", r.status_code, r.reason)
    print("HEADER:", r.headers.get("X-Sandbox-Gateway-Error"))
    print("BODY:", r.text)
    r.raise_for_status()
except requests.RequestException as exc:
    print("MESSAGE:", exc)
    sys.exit(1)
"""


def test_requests_refused_connect(env: Env) -> None:
    out = env.box.run([sys.executable, "-c", REQUESTS, "https://evil.example/"])
    assert out.returncode == 1
    message = out.stdout.partition("MESSAGE:")[2]
    assert "Tunnel connection failed: 403 policy_denied" in message
    _shows(message, "policy_denied", CONNECT_REASON)


def test_requests_refused_request(env: Env) -> None:
    out = env.box.run([sys.executable, "-c", REQUESTS, "https://tools.test/secret"])
    assert out.returncode == 1
    assert "STATUS: 403 policy_denied" in out.stdout and "HEADER: policy_denied" in out.stdout
    message = out.stdout.partition("MESSAGE:")[2]
    assert message.strip().startswith("403 Client Error: policy_denied")
    _shows(message, "policy_denied", path_reason("/secret", "tools.test"))
    _shows(out.stdout.partition("BODY:")[2], "policy_denied", path_reason("/secret",
                                                                           "tools.test"))


def _pip(env: Env, *args: str) -> str:
    out = env.box.run([sys.executable, "-m", "pip", "install", "--no-cache-dir", "--retries",
                       "1", "--timeout", "10", "--disable-pip-version-check", "--target",
                       str(env.box.home / "site"), *args], timeout=60)
    assert out.returncode == 1
    return out.stdout + out.stderr


def test_pip_refused_connect(env: Env) -> None:
    # pip's retry warning quotes the status line (with the default 5 retries, 5 times).
    text = _pip(env, "--index-url", "https://evil.example/simple/", "anything")
    assert "Tunnel connection failed: 403 policy_denied" in text
    _shows(text, "policy_denied", CONNECT_REASON)


def test_pip_refused_request(env: Env) -> None:
    # A refused file download is an error quoting the status line ...
    text = _pip(env, "https://tools.test/pkg-1.0-py3-none-any.whl")
    assert "HTTP error 403 Client Error: policy_denied" in text
    _shows(text, "policy_denied", path_reason("/pkg-1.0-py3-none-any.whl", "tools.test"))
    # ... but pip skips an index page it cannot fetch, saying why only at -vv (debug):
    # by default the agent reads "No matching distribution found".
    quiet = _pip(env, "--index-url", "https://tools.test/simple/", "anything")
    assert "No matching distribution" in quiet and "policy_denied" not in quiet
    loud = _pip(env, "-vv", "--index-url", "https://tools.test/simple/", "anything")
    assert "403 Client Error: policy_denied" in loud
    _shows(loud, "policy_denied", path_reason("/simple/anything/", "tools.test"))


def test_curl_refused_connect(env: Env) -> None:
    out = env.box.run(["curl", "-sS", "--max-time", "10", "https://evil.example/"])
    # curl prints only the status of a refused CONNECT (not its reason phrase or body) ...
    assert out.returncode == 56
    assert "CONNECT tunnel failed, response 403" in out.stderr
    assert "policy_denied" not in out.stderr
    # ... and everything with -v: the status line with code, reason and hint, the code
    # header and Proxy-Status (RFC 9209).
    out = env.box.run(["curl", "-sS", "-v", "--max-time", "10", "https://evil.example/"])
    assert "< HTTP/1.1 403 policy_denied: " + CONNECT_REASON in out.stderr
    assert "< X-Sandbox-Gateway-Error: policy_denied" in out.stderr
    assert "< Proxy-Status: sandbox-gateway; error=http_request_denied; details=" in out.stderr
    _shows(out.stderr, "policy_denied", CONNECT_REASON)


def test_curl_refused_request(env: Env) -> None:
    out = env.box.run(["curl", "-sS", "--max-time", "10", "https://tools.test/secret"])
    assert out.returncode == 0
    _shows(out.stdout, "policy_denied", path_reason("/secret", "tools.test"))
    out = env.box.run(["curl", "-sS", "--fail-with-body", "--max-time", "10",
                       "https://tools.test/secret"])
    assert out.returncode == 22 and "error: 403" in out.stderr
    _shows(out.stdout, "policy_denied", path_reason("/secret", "tools.test"))
