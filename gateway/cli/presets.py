"""`presets`: list the shipped presets; `presets update` refreshes the GitHub service
presets from GitHub's meta API (see services/policy/services/update.py)."""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

__all__ = ["register"]


def _shipped_dir() -> Path:
    import gateway.services.policy.services as services

    return Path(services.__file__).parent


def cmd_presets_list(args: argparse.Namespace) -> int:
    from gateway.services.policy.agents import known_agents, known_services

    for name in (*known_services(), *known_agents()):
        print(name)
    return 0


def cmd_presets_update(args: argparse.Namespace) -> int:
    from gateway.services.policy.loader import load_policy_text
    from gateway.services.policy.services.update import MetaError, fetch_meta, update

    directory = Path(args.dir) if args.dir else _shipped_dir()
    date = args.date or datetime.datetime.now(datetime.UTC).date().isoformat()
    try:
        meta = fetch_meta(args.meta_url, cafile=args.ca_file)
        changed = update(directory, meta, date)
    except (MetaError, OSError) as exc:
        print(f"sandbox-gateway: presets update: {exc}", file=sys.stderr)
        return 1
    for path in changed:  # a rewritten preset must still load
        name = "service/" + path.stem
        load_policy_text("check.yaml", f"version: v1\nname: check\nextends: [{name}]\n")
        print(f"updated {path} (hosts from {args.meta_url}, {date})")
    if not changed:
        print(f"unchanged: the GitHub presets in {directory} already list those hosts")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser],
             common: argparse.ArgumentParser) -> None:
    """Add the `presets` command to the parser."""
    from gateway.services.policy.services.update import META_URL

    presets = sub.add_parser("presets", help="the shipped agent and service presets")
    psub = presets.add_subparsers(dest="presets_command", required=True)
    listing = psub.add_parser("list", parents=[common], help="the shipped presets' names")
    listing.set_defaults(func=cmd_presets_list)
    upd = psub.add_parser("update", parents=[common],
                          help="refresh the GitHub presets' hosts from GitHub's meta API")
    upd.add_argument("--meta-url", default=META_URL, help=f"default: {META_URL}")
    upd.add_argument("--ca-file", help="CA bundle to check the meta API's certificate with")
    upd.add_argument("--dir", help="the presets directory to rewrite (default: the shipped "
                                   "one, gateway/services/policy/services)")
    upd.add_argument("--date", help="the date written in the files (default: today, UTC)")
    upd.set_defaults(func=cmd_presets_update)
