"""The admin listener's one error shape: `{"error": code, "reason": text}` with the code
in `X-Sandbox-Gateway-Error`, as the proxy's refusals carry it."""

from __future__ import annotations

from starlette.responses import JSONResponse

__all__ = ["error"]


def error(status: int, code: str, reason: str) -> JSONResponse:
    return JSONResponse({"error": code, "reason": reason}, status_code=status,
                        headers={"X-Sandbox-Gateway-Error": code})
