"""`state check` and `state backup`: the SQLite state file."""

from __future__ import annotations

import argparse
import contextlib
import sqlite3
import sys
from pathlib import Path

from gateway.cli.common import config_of
from gateway.config import ConfigError


def _state_file(args: argparse.Namespace) -> Path:
    state = config_of(args).state
    if state.get("store", "sqlite") != "sqlite":
        raise ConfigError(f"state.store is {state.get('store')!r}: `state` works on the "
                          "SQLite file (for redis use its own tools, e.g. redis-cli --rdb)")
    return Path(str(state["path"]))


def _mib(size: int) -> str:
    return f"{size / (1024 * 1024):.1f} MiB"


def cmd_state_check(args: argparse.Namespace) -> int:
    """Is the state file sound (integrity, schema, mode)? What does it hold, how big are
    the store's files, how much room is left on its volume?"""
    from gateway.services.state.sqlite_tools import (
        check_file,
        file_sizes,
        log_summary,
        summary,
        volume,
        volume_warning,
    )

    path = Path(args.file) if args.file else _state_file(args)
    problems = check_file(path)
    for problem in problems:
        print(f"problem: {problem}")
    if path.exists() and not any("schema version" in p or "not a database" in p
                                 for p in problems):
        with contextlib.suppress(sqlite3.Error):
            version, rows = summary(path)
            print(f"{path}: schema {version}, " + ", ".join(
                f"{count} {table}" for table, count in rows.items()))
    sizes = file_sizes(path)
    if sizes:
        print("sizes: " + ", ".join(f"{name} {_mib(size)}" for name, size in sizes.items()))
    lines = log_summary(path)
    if lines is not None:
        print(f"request log: {lines[0]} lines in {_mib(lines[1])} of pages in use")
    with contextlib.suppress(OSError):
        free, total = volume(path)
        warning = volume_warning(free, total)
        print(f"volume: {_mib(free)} free of {_mib(total)}" + (
            f"; warning: {warning}" if warning else ""))
    print("FAILED" if problems else "OK")
    return 1 if problems else 0


def cmd_state_backup(args: argparse.Namespace) -> int:
    """An online, consistent copy of the state file (the gateway may keep running)."""
    from gateway.services.state.sqlite_tools import backup_file, check_file

    source = _state_file(args)
    if not source.exists():
        print(f"sandbox-gateway: {source}: no state file (has the gateway run with this "
              "config?)", file=sys.stderr)
        return 1
    target = Path(args.file)
    if target.exists() and not args.force:
        print(f"sandbox-gateway: {target} exists (--force to replace it)", file=sys.stderr)
        return 1
    try:
        backup_file(source, target)
    except (sqlite3.Error, OSError) as exc:
        print(f"sandbox-gateway: backup of {source} to {target} failed: {exc}",
              file=sys.stderr)
        return 1
    problems = check_file(target)
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    print(f"{source} -> {target} ({target.stat().st_size} bytes)")
    return 1 if problems else 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser],
             common: argparse.ArgumentParser) -> None:
    """Add the `state` command to the parser."""
    state = sub.add_parser("state", help="check or back up the state file (SQLite)")
    ssub = state.add_subparsers(dest="state_command", required=True)
    scheck = ssub.add_parser("check", parents=[common],
                             help="integrity, schema version and mode of the state file, "
                                  "what it holds (row counts, no values), the sizes of the "
                                  "store's files and the room left on its volume")
    scheck.add_argument("file", nargs="?", help="a state file or backup (default: "
                                                "state.path from the config)")
    scheck.set_defaults(func=cmd_state_check)
    backup = ssub.add_parser("backup", parents=[common],
                             help="copy the state file online (the gateway keeps running)")
    backup.add_argument("file", help="the copy to write (mode 0600)")
    backup.add_argument("--force", action="store_true", help="replace an existing FILE")
    backup.set_defaults(func=cmd_state_backup)
