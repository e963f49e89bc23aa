"""The admin API as the CLI calls it (`usage`, `approvals`): where it is, its token, and
one JSON call."""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from typing import Any

from gateway.cli.common import config_of
from gateway.config import ConfigError
from gateway.net import ca

__all__ = ["AdminError", "add_arguments", "admin_token", "admin_url", "call"]


class AdminError(Exception):
    """The admin API could not be reached or refused the call (the message says which)."""


def admin_url(args: argparse.Namespace) -> str:
    if args.admin:
        return str(args.admin).rstrip("/")
    admin = config_of(args).listen.admin
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(admin.host, admin.host)
    return f"http://[{host}]:{admin.port}" if ":" in host else f"http://{host}:{admin.port}"


def admin_token(args: argparse.Namespace) -> str:
    if args.token:
        return str(args.token)
    if os.environ.get("SANDBOX_GATEWAY_ADMIN_TOKEN"):
        return os.environ["SANDBOX_GATEWAY_ADMIN_TOKEN"]
    cfg = config_of(args)
    if cfg.admin_token:
        return cfg.admin_token
    path = cfg.certs / ca.ADMIN_TOKEN
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"no admin token: pass --token, set SANDBOX_GATEWAY_ADMIN_TOKEN or "
                          f"admin_token, or make {path} readable ({exc.strerror})") from None


def call(args: argparse.Namespace, method: str, path: str,
         body: dict[str, Any] | None = None) -> Any:
    """One admin API call: its JSON answer. Raises AdminError."""
    url = admin_url(args)
    target = f"{url}{path}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(  # noqa: S310 - an operator-given URL
        target, data=data, method=method, headers={
            "Authorization": f"Bearer {admin_token(args)}", "Accept": "application/json",
            **({"Content-Type": "application/json"} if data is not None else {})})
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:  # noqa: S310
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read()).get("reason", "")
        except (ValueError, AttributeError):
            detail = ""
        raise AdminError(f"{method} {target}: HTTP {exc.code} {detail}".rstrip()) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise AdminError(f"cannot reach the admin API at {url}: {reason}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--admin, --token (and a hidden --timeout) for a command that calls the admin API."""
    parser.add_argument("--admin", metavar="URL",
                        help="admin API URL (default: http://<listen.admin> from the config)")
    parser.add_argument("--token", help="admin token (default: SANDBOX_GATEWAY_ADMIN_TOKEN, "
                        "admin_token, or certs/admin-token)")
    parser.add_argument("--timeout", type=float, default=10.0, help=argparse.SUPPRESS)
