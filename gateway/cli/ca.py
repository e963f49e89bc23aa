"""`ca init`: create the certificate authority sandboxes trust."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gateway.cli.common import config_of
from gateway.net import ca


def cmd_ca_init(args: argparse.Namespace) -> int:
    directory = Path(args.dir) if args.dir else config_of(args).certs
    if (directory / ca.CA_CERT).exists() or (directory / ca.CA_KEY).exists():
        print(f"{directory} already holds a CA; remove ca.crt and ca.key to make a new one",
              file=sys.stderr)
        return 1
    cert, key = ca.create_ca(directory)
    print(f"CA certificate: {cert}\nCA key:         {key} (keep private)")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser],
             common: argparse.ArgumentParser) -> None:
    """Add the `ca` command to the parser."""
    ca_p = sub.add_parser("ca", help="certificate authority")
    csub = ca_p.add_subparsers(dest="ca_command", required=True)
    init = csub.add_parser("init", parents=[common], help="create the CA")
    init.add_argument("--dir", help="directory (default: certs from config)")
    init.set_defaults(func=cmd_ca_init)
