"""`approvals`: answer what ask mode holds, from a terminal (through the admin API).

    sandbox-gateway approvals list [--json]
    sandbox-gateway approvals approve ID [--scope once|sandbox|policy|always]
                                         [--duration 1h] [--note TEXT] [--by NAME]
    sandbox-gateway approvals deny ID [--note TEXT] [--by NAME]
    sandbox-gateway approvals grants [--json]
    sandbox-gateway approvals revoke GRANT [--by NAME]
    sandbox-gateway approvals watch            (or: approvals list --watch)

`watch` prints each new pending approval and asks for an answer on the terminal
(o once, s sandbox, p policy, a always, d deny, Enter skip); with no terminal (stdin at
its end) it only prints. `--by` defaults to the login name.

An MCP tool's change (`what`: ``tool NAME changed on HOST:PORT/PATH``) is shown with its
old and new description and input schema, printed as data (JSON strings: a control
character, an escape sequence or a bidi override in a server's text is shown escaped,
never sent to the terminal); approving pins the new text (no scope), denying keeps the
tool quarantined.
"""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import json
import sys
import time
import unicodedata
from typing import Any

from gateway.cli.admin_client import AdminError, add_arguments, call

__all__ = ["register"]

_KEYS = {"o": ("approve", "once"), "s": ("approve", "sandbox"), "p": ("approve", "policy"),
         "a": ("approve", "always"), "d": ("deny", None)}


def _by(args: argparse.Namespace) -> str:
    if args.by:
        return str(args.by)
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return "cli"


def _when(at: float | None) -> str:
    if at is None:
        return "-"
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _safe(text: object) -> str:
    """`text` with control and format characters (escape sequences, bidi overrides)
    shown escaped: what a sandbox or a server chose never drives the terminal."""
    return "".join(f"\\u{ord(c):04x}" if unicodedata.category(c) in ("Cc", "Cf") else c
                   for c in str(text))


def _change(change: dict[str, Any]) -> str:
    """A tool's old and new text, as data (JSON strings)."""
    old, new = change.get("old") or {}, change.get("new") or {}
    out = []
    for key in ("description", "inputSchema"):
        if key == "inputSchema" and old.get(key) == new.get(key):
            continue
        out.append(f"\n    old {key}: {json.dumps(old.get(key))}"
                   f"\n    new {key}: {json.dumps(new.get(key))}")
    return "".join(out)


def _line(approval: dict[str, Any]) -> str:
    state = approval["state"]
    if state == "pending":
        left = max(0, round(approval["expires"] - time.time()))
        status = f"pending ({left}s left)"
    else:
        status = f"{state} by {_safe(approval['by'])}" if approval.get("by") else state
        if approval.get("scope"):
            status += f" ({approval['scope']})"
    change, consent = approval.get("change"), approval.get("consent")
    if isinstance(consent, dict) and state == "pending":  # (an MCP server's OAuth consent)
        status += f"\n    open and sign in: {_safe(consent.get('url'))}"
    return (f"{approval['id']}  {_safe(approval['sandbox'])} ({_safe(approval['policy'])})  "
            f"{_safe(approval['what'])}  {status}\n    why: {_safe(approval['reason'])}"
            + (_change(change) if isinstance(change, dict) else ""))


def cmd_list(args: argparse.Namespace) -> int:
    if args.watch:
        return cmd_watch(args)
    found = call(args, "GET", "/v1/approvals")["approvals"]
    if args.json:
        print(json.dumps(found, indent=2))
    else:
        print("\n".join(_line(a) for a in found) or "no approvals")
    return 0


def _answer(args: argparse.Namespace, ident: str, decision: str, scope: str | None) -> int:
    body: dict[str, Any] = {"decision": decision, "by": _by(args)}
    for key in ("note", "duration"):
        if getattr(args, key, None):
            body[key] = getattr(args, key)
    if scope and scope != "once":  # (once: the default; a tool's change takes no scope)
        body["scope"] = scope
    got = call(args, "POST", f"/v1/approvals/{ident}", body)
    print(_line(got["approval"]))
    grant = got.get("grant")
    if grant:
        print(f"    grant {grant['id']}: {grant['what']} until {_when(grant['expires'])}")
    proposal = got.get("proposal")
    if proposal:
        where = proposal["branch"] or proposal["problem"] or "no branch"
        print(f"    proposed policy change: {proposal['patch']} ({where}):\n"
              f"{proposal['snippet']}", end="")
    return 0


def cmd_approve(args: argparse.Namespace) -> int:
    return _answer(args, args.id, "approve", args.scope)


def cmd_deny(args: argparse.Namespace) -> int:
    return _answer(args, args.id, "deny", None)


def cmd_grants(args: argparse.Namespace) -> int:
    found = call(args, "GET", "/v1/grants")["grants"]
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    for grant in found:
        who = grant["sandbox"] or f"policy {grant['policy']}"
        print(f"{grant['id']}  {grant['scope']}  {who}  {grant['what']}  by {grant['by']}  "
              f"until {_when(grant['expires'])}")
    if not found:
        print("no grants")
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    call(args, "DELETE", f"/v1/grants/{args.id}", {"by": _by(args)})
    print(f"revoked {args.id}")
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    """Print new pending approvals as they come, and prompt for each (see above)."""
    seen: set[str] = set()
    prompting = True
    while True:
        for approval in call(args, "GET", "/v1/approvals")["approvals"]:
            if approval["state"] != "pending" or approval["id"] in seen:
                continue
            seen.add(approval["id"])
            print(_line(approval), flush=True)
            if not prompting:
                continue
            print("    answer? [o] approve the new text, [d]eny, Enter skips: "
                  if approval.get("change") else
                  "    answer? [o]nce [s]andbox [p]olicy [a]lways [d]eny, Enter skips: ",
                  end="", flush=True)
            reply = sys.stdin.readline()
            if not reply:
                prompting = False  # (no terminal: only print from now on)
                print()
                continue
            choice = _KEYS.get(reply.strip().lower()[:1])
            if choice is not None:
                try:
                    _answer(args, approval["id"], *choice)
                except AdminError as exc:
                    print(f"    not answered: {exc}", flush=True)
        if args.once:
            return 0
        time.sleep(args.interval)


def _run(handler: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            return int(handler(args))
        except AdminError as exc:
            print(f"sandbox-gateway: {exc}", file=sys.stderr)
            return 1
    return run


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser],
             common: argparse.ArgumentParser) -> None:
    """Add the `approvals` command to the parser."""
    approvals = sub.add_parser("approvals", help="answer what ask mode holds (admin API)")
    asub = approvals.add_subparsers(dest="approvals_command", required=True)

    def verb(name: str, handler: Any, text: str) -> argparse.ArgumentParser:
        parser = asub.add_parser(name, parents=[common], help=text)
        add_arguments(parser)
        parser.set_defaults(func=_run(handler))
        return parser

    listing = verb("list", cmd_list, "pending approvals first, then the answered")
    listing.add_argument("--json", action="store_true", help="print the JSON answer")
    listing.add_argument("--watch", action="store_true",
                         help="keep watching, prompting for each new ask (as `watch`)")
    watch = verb("watch", cmd_watch, "print new asks and prompt for answers")
    for parser in (listing, watch):
        parser.add_argument("--interval", type=float, default=1.0, help=argparse.SUPPRESS)
        parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
        parser.add_argument("--by", help="who answers (default: the login name)")
    approve = verb("approve", cmd_approve, "approve a held request")
    approve.add_argument("id")
    approve.add_argument("--scope", choices=["once", "sandbox", "policy", "always"],
                         default="once", help="once (default); this sandbox or every "
                         "sandbox of the policy for --duration; always (a policy change "
                         "proposed for review)")
    approve.add_argument("--duration", help="for sandbox and policy scopes (default 1h)")
    deny = verb("deny", cmd_deny, "deny a held request (the agent is told a person said no)")
    deny.add_argument("id")
    for parser in (approve, deny):
        parser.add_argument("--note", help="why (shown to the agent and in the audit)")
        parser.add_argument("--by", help="who answers (default: the login name)")
    grants = verb("grants", cmd_grants, "grants in force")
    grants.add_argument("--json", action="store_true", help="print the JSON answer")
    revoke = verb("revoke", cmd_revoke, "revoke a grant (its tunnels close)")
    revoke.add_argument("id")
    revoke.add_argument("--by", help="who revokes (default: the login name)")
