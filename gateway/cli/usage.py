"""`usage`: inference usage and budgets, read from the admin API."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.parse
from typing import Any

from gateway.cli.admin_client import AdminError, add_arguments, call


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    numeric = [i >= 4 for i in range(len(header))]
    return ["  ".join(cell.rjust(w) if num else cell.ljust(w)
                      for cell, w, num in zip(row, widths, numeric, strict=True)).rstrip()
            for row in [header, *rows]]


def _usage_lines(report: dict[str, Any]) -> list[str]:
    def cost(value: Any) -> str:
        return "-" if value is None else f"{float(value):.4f}"

    columns = ("requests", "unknown_requests", "input_tokens", "output_tokens",
               "cached_input_tokens")
    header = ["POLICY", "SANDBOX", "CREDENTIAL", "MODEL", "REQUESTS", "NO_USAGE", "INPUT",
              "OUTPUT", "CACHED", "COST_USD"]
    rows = [[r["policy"], r["sandbox"], r["credential"], r["model"],
             *(f"{r[c]:,}" for c in columns), cost(r["cost_usd"])] for r in report["rows"]]
    t = report["totals"]
    rows.append(["TOTAL", "", "", "", *(f"{t[c]:,}" for c in columns), cost(t["cost_usd"])])
    lines = [f"usage from {report['since']} to {report['until']}"]
    lines += _table(header, rows)
    if report["budgets"]:
        lines.append("")
        lines.append("budgets:")
    for b in report["budgets"]:
        used, limits = b["used"], b["limits"]
        reserved = b.get("reserved") or {}
        parts = []
        for kind, limit in limits.items():
            held = reserved.get(kind) or 0
            if kind == "cost_usd":
                part = f"{kind} {used[kind]:,.2f}" + (f" (+{held:,.2f} reserved)" if held
                                                      else "") + f" of {limit:,.2f}"
            else:
                part = f"{kind} {used[kind]:,}" + (f" (+{held:,} reserved)" if held
                                                   else "") + f" of {limit:,}"
            parts.append(part)
        state = "USED UP" if b["exceeded"] else "ok"
        lines.append(f"  {b['policy']}/{b['budget']} per {b['per']} {b['subject']!r}, "
                     f"{b['window']} window from {b['window_start']}: {'; '.join(parts)} "
                     f"[{state}, resets {b['resets_at']}]")
    if report.get("degraded"):
        lines.append("")
        lines.append("WARNING: the shared state store is unreachable: these are this "
                     "gateway process's local counts")
    return lines


def cmd_usage(args: argparse.Namespace) -> int:
    query = {k: v for k, v in (("sandbox", args.sandbox), ("policy", args.policy),
                               ("since", args.since)) if v}
    try:
        report = call(args, "GET", "/v1/usage" + (f"?{urllib.parse.urlencode(query)}"
                                                   if query else ""))
    except AdminError as exc:
        print(f"sandbox-gateway: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print("\n".join(_usage_lines(report)))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser],
             common: argparse.ArgumentParser) -> None:
    """Add the `usage` command to the parser."""
    usage = sub.add_parser("usage", parents=[common],
                           help="inference usage and budgets (from the admin API)")
    usage.add_argument("--sandbox", help="only this sandbox")
    usage.add_argument("--policy", help="only this policy (also shows its budgets)")
    usage.add_argument("--since", help="ISO 8601 time or duration back from now, e.g. 24h "
                       "(default: everything kept, metering.retention)")
    add_arguments(usage)
    usage.add_argument("--json", action="store_true", help="print the JSON answer")
    usage.set_defaults(func=cmd_usage)
