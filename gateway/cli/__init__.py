"""`sandbox-gateway` (also `python -m gateway`): run, token, config, policy, presets, ca,
env, node-preload, usage, state, approvals, mcp-oauth.

A module per command group (run, token, config, policy, ca, env, usage, state,
approvals, mcp_oauth), each
with its `register`; this module builds the parser from them and runs a command.

Every subcommand takes `--config FILE`; without it the embedded defaults apply
(policies from ./policies, CA and keys in ./certs, the file secret store).
"""

from __future__ import annotations

import argparse
import sys

from gateway import __version__
from gateway.cli import approvals, env, mcp_oauth, policy, presets, run, state, token, usage
from gateway.cli import ca as ca_cmd
from gateway.cli import config as config_cmd
from gateway.config import ConfigError
from gateway.net import ca
from gateway.services.identity.tokens import TokenError
from gateway.services.policy import PolicyError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand's own --config default must not erase one given before it.
    common.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help="gateway.yaml (default: built-in)")
    parser = argparse.ArgumentParser(
        prog="sandbox-gateway", description="Secrets-and-egress gateway for AI sandboxes.",
        parents=[common])
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)

    for group in (run, token, config_cmd, policy, presets, ca_cmd, env, usage, state,
                  approvals, mcp_oauth):
        group.register(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ConfigError, PolicyError, TokenError, ca.CAError) as exc:
        errors = getattr(exc, "errors", None)
        if errors:
            for error in errors:
                print(error, file=sys.stderr)
        else:
            print(f"sandbox-gateway: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
