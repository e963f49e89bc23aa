"""The admin listener's one error shape: `{"error": code, "reason": text}` with the code
in `X-Sandbox-Gateway-Error`, as the proxy's refusals carry it."""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

__all__ = ["error", "raw_answer", "raw_error"]


def error(status: int, code: str, reason: str) -> JSONResponse:
    return JSONResponse({"error": code, "reason": reason}, status_code=status,
                        headers={"X-Sandbox-Gateway-Error": code})


def raw_answer(status: int, phrase: str, body: dict[str, object], *, code: str | None = None,
               head_only: bool = False) -> bytes:
    """A whole JSON answer as bytes, `Connection: close`, for the admin listener's
    protocol to write itself (no request cycle: a timeout, a refusal at the cap, a probe
    answered past the cap). `head_only`: the answer to a HEAD request."""
    data = json.dumps(body).encode()
    fields = [(b"content-type", b"application/json")]
    if code is not None:
        fields.append((b"x-sandbox-gateway-error", code.encode()))
    fields += [(b"content-length", str(len(data)).encode()), (b"connection", b"close")]
    head = b"".join(k + b": " + v + b"\r\n" for k, v in fields)
    return (f"HTTP/1.1 {status} {phrase}\r\n".encode() + head + b"\r\n"
            + (b"" if head_only else data))


def raw_error(status: int, phrase: str, code: str, reason: str) -> bytes:
    """An error answer in the admin API's shape, as bytes (see `raw_answer`)."""
    return raw_answer(status, phrase, {"error": code, "reason": reason}, code=code)
