"""Refusals: fixed codes, one status each, rendered the same way by every engine.

A `Refusal` says what was refused (`code`), why and what to change (`reason`), and by
which rule (`file:line`). Reasons are built only from fixed sentences, policy names,
hosts and paths — never from bytes an upstream sent (an upstream may echo a key) and
never from a token or secret. `answer()` renders a refusal once into an `Answer`
(status, reason phrase, headers, body) that the HTTP/1 engine writes as bytes and the
mitmproxy adapter turns into its own response object, for HTTP/1 and HTTP/2 alike.

What a client shows:
- the JSON body `{"error": code, "reason": …, "rule": …, "hint": …}` plus
  `X-Sandbox-Gateway-Error: code`; on hosts of a provider preset the body takes the
  provider's error shape (OpenAI, Anthropic, Gemini), so the official SDKs surface
  the reason to the agent instead of a bare status;
- the reason phrase `<code>: <reason> (<hint>)` (requests, pip and the Python SDKs'
  tracebacks print only the status line of a refused CONNECT: "Tunnel connection
  failed: 403 policy_denied: … (refused by the sandbox's egress gateway; …)"), so the
  hint not to retry around the proxy reaches the agent there too;
- `Proxy-Status` (RFC 9209) naming the gateway, the error type and the details.

A used-up budget (`budget_exceeded`) that has no room again within minutes is final for
now, and is answered as the provider's own quota refusal, which SDKs and agents stop on
instead of waiting out a `Retry-After` of hours: OpenAI's `429 insufficient_quota`,
Anthropic's `400 invalid_request_error` (its answer to a spent credit balance), Gemini's
`429 RESOURCE_EXHAUSTED` with a `QuotaFailure` and the `RetryInfo` of the reset; with
`x-should-retry: false`, which the official OpenAI and Anthropic SDKs obey over the
status. One that frees room soon keeps the rate-limit shape and its `Retry-After`. The
gateway's code stays in the message, `X-Sandbox-Gateway-Error` and `Proxy-Status`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.core.messages import Headers

if TYPE_CHECKING:
    from gateway.core.identity import Identity

__all__ = [
    "ERROR_HEADER",
    "GATEWAY_ERROR",
    "QUOTA",
    "RPC_REFUSED",
    "SHOULD_RETRY",
    "TEXT",
    "Answer",
    "MessageRefused",
    "Refusal",
    "StateUnavailable",
    "answer",
    "answered_inside_tls",
    "rpc_error",
    "status_of",
    "to_http1",
    "ws_error",
]

ERROR_HEADER = "X-Sandbox-Gateway-Error"
QUOTA = "budget_exceeded"  # the refusal answered in a provider's quota shape when final
SHOULD_RETRY = "x-should-retry"  # the OpenAI and Anthropic SDKs obey it over the status
RPC_REFUSED = -32001  # a JSON-RPC (MCP) request refused: an implementation-defined server error
AGENT_HINT = ("refused by the sandbox's egress gateway; retrying the same request another "
              "way (another host, address, proxy setting or encoding) is refused too")

# code -> (status, RFC 9209 error type)
_CODES: dict[str, tuple[int, str]] = {
    "auth_required": (407, "http_request_denied"),
    "sandbox_mismatch": (407, "http_request_denied"),
    "unknown_sandbox": (407, "http_request_denied"),
    "identity_unknown": (407, "http_request_denied"),
    "identity_unavailable": (503, "proxy_internal_error"),
    "unknown_policy": (403, "http_request_denied"),
    "policy_denied": (403, "http_request_denied"),
    "host_mismatch": (403, "http_request_denied"),
    "forbidden_destination": (403, "destination_ip_prohibited"),
    "bad_destination": (403, "destination_not_found"),
    "credential_not_in_scope": (403, "http_request_denied"),
    "credential_required": (401, "http_request_denied"),
    "credential_requires_tls": (403, "http_request_denied"),
    "exfiltration_blocked": (403, "http_request_denied"),
    "secret_detected": (403, "http_request_denied"),
    "model_not_allowed": (403, "http_request_denied"),
    "mcp_denied": (403, "http_request_denied"),
    "mcp_tool_changed": (403, "http_request_denied"),
    "mcp_token_refused": (403, "http_request_denied"),
    "mcp_consent_required": (403, "http_request_denied"),
    "mcp_user_required": (403, "http_request_denied"),
    "mcp_oauth_failed": (502, "destination_unavailable"),
    "approval_denied": (403, "http_request_denied"),
    "approval_timeout": (403, "http_request_denied"),
    "metering_unavailable": (403, "http_request_denied"),
    "minted_secret_refused": (403, "http_request_denied"),
    "budget_exceeded": (429, "http_request_denied"),
    "too_many_connections": (429, "http_request_denied"),
    "bad_request": (400, "http_request_error"),
    "unsupported": (501, "http_request_error"),
    "upstream_failed": (502, "destination_unavailable"),
    "upstream_proxy_failed": (502, "destination_unavailable"),
    "unresolvable": (502, "dns_error"),
    "upstream_timeout": (504, "connection_read_timeout"),
    "secret_unavailable": (503, "proxy_internal_error"),
    "credential_unavailable": (503, "proxy_internal_error"),
    "shutting_down": (503, "proxy_internal_error"),
    "at_capacity": (503, "proxy_internal_error"),
    "audit_unavailable": (503, "proxy_internal_error"),
    "state_unavailable": (503, "proxy_internal_error"),
    "gateway_error": (500, "proxy_internal_error"),
}
_PHRASES = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
            407: "Proxy Authentication Required",
            429: "Too Many Requests", 500: "Internal Server Error", 501: "Not Implemented",
            502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}


# Refusals of a CONNECT that are answered at the CONNECT even where refusals go inside
# TLS: a missing token (the 407 challenge is what makes clients send credentials), a
# gateway too busy, unable to audit or without its state store (no TLS handshake spent on
# it), an authority the gateway cannot name a leaf for, and its own failure.
_AT_CONNECT = frozenset({"auth_required", "at_capacity", "too_many_connections",
                         "audit_unavailable", "state_unavailable", "shutting_down",
                         "bad_request",
                         "bad_destination", "gateway_error"})
TEXT = "text"  # the shape of a refusal for a client that shows only text/plain (git)


def answered_inside_tls(code: str) -> bool:
    """A refused CONNECT with this code may be answered inside TLS (see _AT_CONNECT)."""
    return code not in _AT_CONNECT


def status_of(code: str) -> int:
    """The HTTP status of a refusal code (token_* codes are 407: a token problem)."""
    if code.startswith("token_"):
        return 407
    return _CODES.get(code, (403, ""))[0]


class Refusal(Exception):
    """A refused request or connection. `retry_after`: seconds, for 429/503 answers.
    `resets_in`: for a used-up budget, the seconds until it has room again (the Gemini
    shape's `RetryInfo`); with no `retry_after` such a refusal is final (`final_quota`).
    `identity`: who a refused token names, when its signature verified (a token refused
    for time or revocation), for the audit line only: the client is not identified by it.

    A plain exception class (not a frozen dataclass: Python must be able to set
    `__traceback__` when it is raised through context managers)."""

    def __init__(self, code: str, reason: str, rule: str | None = None,
                 retry_after: int | None = None, credential: str | None = None,
                 identity: Identity | None = None,
                 rpc: tuple[list[Any], bool] | None = None,
                 resets_in: int | None = None) -> None:
        super().__init__(code, reason)
        self.code = code
        self.reason = reason
        self.rule = rule
        self.retry_after = retry_after
        self.credential = credential  # the credential that could not be supplied, if any
        self.identity = identity
        self.rpc = rpc  # MCP: (the refused requests' JSON-RPC ids, a batch?): a JSON-RPC answer
        self.resets_in = resets_in

    def __str__(self) -> str:
        return f"{self.code}: {self.reason}"


    @property
    def status(self) -> int:
        """The HTTP status of the answer: the code's, except for refused MCP requests,
        which are answered as JSON-RPC errors in a 200 (Streamable HTTP's answer to a
        request; MCP clients show the error, where a 4xx is a transport failure)."""
        if self.rpc is not None and self.rpc[0]:
            return 200
        return status_of(self.code)

    @property
    def final_quota(self) -> bool:
        """A used-up budget with no room again soon: answered in the provider's quota
        shape, without `Retry-After` (waiting would not help)."""
        return self.code == QUOTA and self.retry_after is None


class StateUnavailable(Refusal):
    """The shared state store could not be reached; what was asked of it was not done.
    Raised by the stores (`services/state`); where it reaches a request it is refused
    `503 state_unavailable` like any Refusal, with a fixed reason (the detail, which may
    name the store's address, is only in `str()`, for logs and the operator's API)."""

    def __init__(self, detail: str) -> None:
        super().__init__("state_unavailable", "the gateway's state store (grants, "
                         "approvals, budgets, revocations) did not answer while this "
                         "request needed it, and the gateway refuses the request rather "
                         "than decide without it; retry later", retry_after=5)
        self.detail = detail

    def __str__(self) -> str:
        return self.detail


class MessageRefused(Exception):
    """One WebSocket message refused (audited) while its session goes on: the engine
    drops the message and sends ``reply`` to the client (the provider's error event, the
    JSON-RPC errors of an MCP session; empty: nothing to send)."""

    def __init__(self, refusal: Refusal, reply: bytes) -> None:
        super().__init__(refusal.code)
        self.refusal = refusal
        self.reply = reply


GATEWAY_ERROR = Refusal(
    "gateway_error",
    "the gateway failed while checking this request and refused it (fail closed); "
    "the gateway log has the details",
)


@dataclass(frozen=True, slots=True)
class Answer:
    """A response the gateway makes itself (a refusal, or the sandbox-facing API)."""

    status: int
    reason: str
    headers: Headers
    body: bytes
    close: bool = False


_PHRASE_MAX = 1000  # well under every client's status-line limit (Node: 16 KiB head)


def _phrase(refusal: Refusal) -> str:
    """A reason phrase: printable ASCII only, no CR/LF, bounded; the reason is cut
    before the agent hint is."""
    hint = f" ({AGENT_HINT})"
    text = f"{refusal.code}: {refusal.reason}"
    clean = "".join(c if " " <= c <= "~" else "?" for c in text)
    if len(clean) + len(hint) > _PHRASE_MAX:
        clean = clean[:_PHRASE_MAX - len(hint) - 3] + "..."
    return clean + hint


def _sf_string(text: str) -> str:
    """An RFC 8941 sf-string (for Proxy-Status details)."""
    clean = "".join(c if " " <= c <= "~" else "?" for c in text)[:500]
    return '"' + clean.replace("\\", "\\\\").replace('"', '\\"') + '"'


def rpc_error(refusal: Refusal, ident: Any) -> dict[str, Any]:
    """The JSON-RPC error answering request `ident` (None: what was not a request) that
    `refusal` refused: what an MCP client shows as the call's error."""
    return {"jsonrpc": "2.0", "id": ident,
            "error": {"code": RPC_REFUSED,
                      "message": f"{refusal.code}: {refusal.reason} ({AGENT_HINT})",
                      "data": {"code": refusal.code, "rule": refusal.rule}}}


def _body(refusal: Refusal, status: int, shape: str | None) -> bytes:
    message = f"{refusal.code}: {refusal.reason} ({AGENT_HINT})"
    if refusal.rpc is not None:  # an MCP call: answered as JSON-RPC, which its client shows
        ids, batch = refusal.rpc
        errors = [rpc_error(refusal, ident) for ident in (ids or [None])]
        return json.dumps(errors if batch and ids else errors[0]).encode() + b"\n"
    if shape == TEXT:  # (git prints a text/plain body as "remote: ..." lines)
        rule = f"\nrule: {refusal.rule}" if refusal.rule else ""
        return f"sandbox-gateway refused this request: {message}{rule}\n".encode()
    if shape == "openai":
        kind, code = ((_INSUFFICIENT_QUOTA, _INSUFFICIENT_QUOTA) if refusal.final_quota
                      else (_openai_type(status), refusal.code))
        doc: object = {"error": {"message": message, "type": kind, "code": code,
                                 "param": None, "rule": refusal.rule}}
    elif shape == "anthropic":
        kind = _error_type(status)
        doc = {"type": "error", "error": {"type": kind, "message": message,
                                          "code": refusal.code, "rule": refusal.rule}}
    elif shape == "gemini":
        grpc = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 407: "UNAUTHENTICATED",
                429: "RESOURCE_EXHAUSTED", 504: "DEADLINE_EXCEEDED", 500: "INTERNAL",
                501: "UNIMPLEMENTED"}.get(status, "UNAVAILABLE" if status >= 500
                                          else "PERMISSION_DENIED")
        details = (_quota_details(refusal) if refusal.code == QUOTA else
                   [{"reason": refusal.code, "rule": refusal.rule}])
        doc = {"error": {"code": status, "message": message, "status": grpc,
                         "details": details}}
    else:
        doc = {"error": refusal.code, "reason": refusal.reason, "rule": refusal.rule,
               "hint": AGENT_HINT}
    return json.dumps(doc).encode() + b"\n"


_INSUFFICIENT_QUOTA = "insufficient_quota"  # OpenAI's type and code for a spent quota
_GOOGLE_RPC = "type.googleapis.com/google.rpc."


def _quota_details(refusal: Refusal) -> list[dict[str, Any]]:
    """The `details` of a used-up budget on Gemini: a `QuotaFailure`, the `RetryInfo`
    of when it has room again and an `ErrorInfo` with the gateway's code. The Gemini
    CLI retries a 429 whose `RetryInfo` is at most 300 s away and stops on a longer one,
    showing the message (`classifyGoogleError`); without `RetryInfo` it would retry."""
    details: list[dict[str, Any]] = [
        {"@type": _GOOGLE_RPC + "QuotaFailure", "violations": [{
            "subject": f"sandbox-gateway budget ({refusal.rule})",
            "description": refusal.reason[:500], "quotaId": "SandboxGatewayBudget"}]}]
    delay = refusal.retry_after if refusal.retry_after is not None else refusal.resets_in
    if delay is not None:
        details.append({"@type": _GOOGLE_RPC + "RetryInfo", "retryDelay": f"{max(0, delay)}s"})
    details.append({"@type": _GOOGLE_RPC + "ErrorInfo", "reason": refusal.code.upper(),
                    "domain": "sandbox-gateway",
                    "metadata": {"code": refusal.code, "rule": refusal.rule or ""}})
    return details


def _status(refusal: Refusal, shape: str | None) -> int:
    """The answer's status. A final used-up budget on Anthropic is its `400
    invalid_request_error`, what Anthropic answers for a spent credit balance or a
    reached spend limit: its SDKs retry every 429 (with their backoff, or for as long as
    `Retry-After` says) and Claude Code retries 429s up to ten times, but neither
    retries a 400, so the agent stops at once and shows the message."""
    if shape == "anthropic" and refusal.final_quota:
        return 400
    return refusal.status


def _openai_type(status: int) -> str:
    """OpenAI's error type for a status: every refusal but 429 and 5xx is an
    `invalid_request_error` there (a 403 too), which is what clients key on: LiteLLM (and
    so Aider) retries an OpenAI error of any other type, a refusal included, for a minute."""
    return ("rate_limit_error" if status == 429 else
            "server_error" if status >= 500 else "invalid_request_error")


def _error_type(status: int) -> str:
    """Anthropic's error type for a status."""
    return ("invalid_request_error" if status == 400 else
            "authentication_error" if status in (401, 407) else
            "rate_limit_error" if status == 429 else
            "api_error" if status >= 500 else "permission_error")


def ws_error(refusal: Refusal, session: str, *, event_id: str = "",
             stream_id: str | None = None) -> bytes:
    """A refused WebSocket message answered as the provider's own error event, which the
    SDKs and agents show: a Realtime session's (``error`` with an ``event_id``) or the
    Responses API's over WebSocket (``error`` with the HTTP ``status``)."""
    message = f"{refusal.code}: {refusal.reason} ({AGENT_HINT})"
    status = refusal.status
    kind, code = ((_INSUFFICIENT_QUOTA, _INSUFFICIENT_QUOTA) if refusal.final_quota
                  else (_openai_type(status), refusal.code))
    error: dict[str, object] = {"type": kind, "code": code, "message": message,
                                "param": None}
    doc: dict[str, object]
    if session == "responses_ws":
        doc = {"type": "error", "status": status, "error": error}
        if stream_id is not None:
            doc["stream_id"] = stream_id
    else:
        doc = {"type": "error", "event_id": event_id or "event_sandbox_gateway",
               "error": {**error, "event_id": None}}
    return json.dumps(doc).encode()


def answer(refusal: Refusal, *, shape: str | None = None, close: bool = False) -> Answer:
    """Render `refusal` (`shape`: the provider preset family of the target, if any)."""
    status = _status(refusal, shape)
    body = _body(refusal, status, shape)
    error_type = _CODES.get(refusal.code, (0, "http_request_denied"))[1] or \
        "http_request_denied"
    headers = Headers.of(
        ("Content-Type", "text/plain; charset=utf-8" if shape == TEXT else "application/json"),
        (ERROR_HEADER, refusal.code),
        ("Proxy-Status", f"sandbox-gateway; error={error_type}; "
                         f"details={_sf_string(f'{refusal.code}: {refusal.reason}')}"),
        ("Cache-Control", "no-store"),
    )
    if status == 407:
        headers.set("Proxy-Authenticate", 'Basic realm="sandbox-gateway"')
        close = True
    if refusal.code == "credential_required":  # git then asks its credential helper
        headers.set("WWW-Authenticate", 'Basic realm="sandbox-gateway"')
    if refusal.retry_after is not None:
        headers.set("Retry-After", str(max(0, int(refusal.retry_after))))
    elif refusal.final_quota:
        headers.set(SHOULD_RETRY, "false")
    headers.set("Content-Length", str(len(body)))
    headers.set("Connection", "close" if close else "keep-alive")
    return Answer(status, _phrase(refusal), headers, body, close)


def to_http1(ans: Answer, version: str = "HTTP/1.1") -> bytes:
    """The wire bytes of an answer on HTTP/1."""
    lines = [f"{version} {ans.status} {ans.reason}".encode("latin-1")]
    lines += [k + b": " + v for k, v in ans.headers.fields]
    return b"\r\n".join(lines) + b"\r\n\r\n" + ans.body
