"""Errors mitmproxy itself answers (upstream unreachable, TLS to upstream failed, bad
request) in the gateway's shape: JSON `{"error", "reason", "rule"}` plus the
`X-Sandbox-Gateway-Error` header, instead of mitmproxy's HTML page.

mitmproxy builds those HTTP/1 responses in one module-level function
(`mitmproxy.proxy.layers.http._http1.make_error_response`); `install()` replaces it
for this process. A connection that the destination check refused in `server_connect`
(message "refused: …") is reported as the 403 it is.
"""

from __future__ import annotations

import re

from mitmproxy.net.http import http1, status_codes
from mitmproxy.proxy.layers.http import _http1

from gateway.errors import Refusal

REFUSED_MARK = "refused: "
# Parse errors quote what the upstream sent (`b'...'`), which can be anything it
# knows — an injected key included: those bytes never reach the sandbox.
_UPSTREAM_BYTES = re.compile(r"""(?<![\w])b(['"]).*?(?<!\\)\1|(?<![\w])b(['"]).*""")


def error_response(status_code: int, message: str = "") -> bytes:
    """The wire bytes of an error answered by mitmproxy's HTTP/1 layer."""
    if REFUSED_MARK in message:
        refusal = Refusal("forbidden_destination", message.split(REFUSED_MARK, 1)[1][:500])
    elif status_code in (502, 504):
        detail = _UPSTREAM_BYTES.sub("<bytes>", message)[:300] or status_code
        refusal = Refusal("upstream_failed", f"the upstream could not be reached or answered "
                          f"badly ({detail}); check that it is up and, for "
                          "TLS, that its certificate is valid (network.upstream_ca adds CAs)")
    elif status_code == 400:
        refusal = Refusal("bad_request", f"the request could not be parsed: {message[:300]}")
    else:
        refusal = Refusal("gateway_error", message[:300] or "the gateway could not serve this")
    response = refusal.response()
    response.status_code = status_code if refusal.code != "forbidden_destination" else 403
    response.reason = status_codes.RESPONSES.get(response.status_code, "")
    response.headers["Connection"] = "close"
    wire: bytes = http1.assemble_response(response)  # type: ignore[no-untyped-call]
    return wire


def install() -> None:
    """Use `error_response` for mitmproxy's HTTP/1 error answers in this process."""
    _http1.make_error_response = error_response
