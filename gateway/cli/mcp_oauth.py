"""`mcp-oauth`: the grants the gateway holds as MCP servers' OAuth client (rules with
`mcp.oauth`, docs/mcp-oauth.md), through the admin API. Tokens are never shown.

    sandbox-gateway mcp-oauth list [--json]
    sandbox-gateway mcp-oauth revoke GRANT [--by NAME]

A consent is asked as an approval (`sandbox-gateway approvals list` shows its
authorization URL: open it and sign in); `revoke` forgets a grant on every process and
asks its authorization server to revoke its tokens, so the next request asks again.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from gateway.cli.admin_client import add_arguments, call
from gateway.cli.approvals import _by, _run, _safe, _when

__all__ = ["register"]


def _line(grant: dict[str, Any]) -> str:
    scopes = " ".join(grant.get("scopes") or []) or "-"
    return (f"{grant['id']}  {_safe(grant['owner'])}  {_safe(grant['server'])}  "
            f"scopes {_safe(scopes)}  token until {_when(grant.get('expires_at'))}\n"
            f"    issuer {_safe(grant['issuer'])}, client {_safe(grant['client_id'])}, "
            f"granted {_when(grant.get('created'))}"
            + ("  (stale: refreshed on next use)" if grant.get("stale") else "")
            + ("  (more scopes asked: consent again)" if grant.get("step_up") else ""))


def cmd_list(args: argparse.Namespace) -> int:
    found = call(args, "GET", "/v1/mcp/oauth/grants")["grants"]
    if args.json:
        print(json.dumps(found, indent=2))
    else:
        print("\n".join(_line(g) for g in found) or "no MCP OAuth grants")
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    got = call(args, "DELETE", f"/v1/mcp/oauth/grants/{args.id}", {"by": _by(args)})
    print(f"revoked {got['revoked']}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser],
             common: argparse.ArgumentParser) -> None:
    """Add the `mcp-oauth` command to the parser."""
    group = sub.add_parser("mcp-oauth", help="MCP servers' OAuth grants (admin API)")
    gsub = group.add_subparsers(dest="mcp_oauth_command", required=True)

    def verb(name: str, handler: Any, text: str) -> argparse.ArgumentParser:
        parser = gsub.add_parser(name, parents=[common], help=text)
        add_arguments(parser)
        parser.set_defaults(func=_run(handler))
        return parser

    listing = verb("list", cmd_list, "the grants held (never a token)")
    listing.add_argument("--json", action="store_true", help="print the JSON answer")
    revoke = verb("revoke", cmd_revoke, "forget a grant and revoke its tokens")
    revoke.add_argument("id")
    revoke.add_argument("--by", help="who revokes (default: the login name)")
