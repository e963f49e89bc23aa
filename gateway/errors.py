"""Refusals a sandbox sees: few codes, one status each, one JSON body shape.

Body: `{"error": code, "reason": text, "rule": file:line | null}` plus the header
`X-Sandbox-Gateway-Error: code`. The reason tells a person what to change. Nothing
here ever includes a token or a secret: reasons are built from fixed strings,
policy names, hosts and paths.
"""

from __future__ import annotations

import json

from mitmproxy import http

ERROR_HEADER = "X-Sandbox-Gateway-Error"

STATUS_BY_CODE: dict[str, int] = {
    "auth_required": 407,
    "sandbox_mismatch": 407,
    "policy_denied": 403,
    "host_mismatch": 403,
    "forbidden_destination": 403,
    "bad_destination": 403,
    "credential_not_in_scope": 403,
    "exfiltration_blocked": 403,
    "unknown_sandbox": 407,
    "upstream_failed": 502,
    "unresolvable": 502,
    "secret_unavailable": 503,
    "gateway_error": 500,
    "bad_request": 400,
}


class Refusal(Exception):
    """A refused request: `code` picks the status, `reason` says what to change.

    A plain exception class (not a frozen dataclass: Python must be able to set
    `__traceback__` when it is raised through context managers)."""

    def __init__(self, code: str, reason: str, rule: str | None = None) -> None:
        super().__init__(code, reason)
        self.code = code
        self.reason = reason
        self.rule = rule

    def __str__(self) -> str:
        return f"{self.code}: {self.reason}"

    @property
    def status(self) -> int:
        if self.code.startswith("token_"):
            return 407
        return STATUS_BY_CODE.get(self.code, 403)

    def body(self) -> bytes:
        return json.dumps({"error": self.code, "reason": self.reason, "rule": self.rule}).encode()

    def response(self) -> http.Response:
        """A mitmproxy response for this refusal (407s ask for proxy credentials)."""
        headers = {"Content-Type": "application/json", ERROR_HEADER: self.code,
                   "Connection": "close" if self.status == 407 else "keep-alive"}
        if self.status == 407:
            headers["Proxy-Authenticate"] = 'Basic realm="sandbox-gateway"'
        return http.Response.make(self.status, self.body() + b"\n", headers)


GATEWAY_ERROR = Refusal(
    "gateway_error",
    "the gateway failed while checking this request and refused it (fail closed); "
    "the gateway log has the details",
)
