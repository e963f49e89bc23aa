"""The environment a sandbox needs: proxy URL with its token, CA bundle, API-key vars.

The `*_API_KEY` variables hold the gateway token, never a key: SDKs put it in their
usual header and the gateway swaps it for the real key on the way out.
"""

from __future__ import annotations

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
)


def proxy_url(proxy: str, sandbox: str, token: str) -> str:
    """`http://gateway:8080` -> `http://<sandbox>:<token>@gateway:8080`."""
    parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    netloc = f"{quote(sandbox, safe='')}:{quote(token, safe='')}@{parts.hostname}"
    if ":" in (parts.hostname or ""):
        netloc = f"{quote(sandbox, safe='')}:{quote(token, safe='')}@[{parts.hostname}]"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme or "http", netloc, "", "", ""))


def sandbox_env(token: str, proxy: str, sandbox: str | None = None,
                ca_bundle: str = "/etc/sandbox-gateway/ca-bundle.pem") -> list[str]:
    """`KEY=value` lines for a sandbox (an env file for `docker run --env-file`)."""
    sandbox = sandbox or str(unverified_claims(token).get("sub") or "sandbox")
    url = proxy_url(proxy, sandbox, token)
    lines = [f"HTTPS_PROXY={url}", f"HTTP_PROXY={url}", f"https_proxy={url}",
             f"http_proxy={url}", "NO_PROXY=localhost,127.0.0.1,::1",
             "no_proxy=localhost,127.0.0.1,::1"]
    lines += [f"{var}={ca_bundle}" for var in CA_VARIABLES]
    lines += [f"{var}={token}" for var in API_KEY_VARIABLES]
    return lines
