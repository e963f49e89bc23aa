"""`sandbox-gateway` (also `python -m gateway`): run, token, config, policy, presets, ca,
env, node-preload, usage, state, approvals, mcp-oauth.

A module per command group (run, token, config, policy, ca, env, usage, state,
approvals, mcp_oauth), each
with its `register`; this module builds the parser from them and runs a command. For
`run` it is built from `run`'s module alone (`__main__` says so): a gateway process holds
none of the other commands' modules (a worker's idle memory; issue 41).

Every subcommand takes `--config FILE`; without it the embedded defaults apply
(policies from ./policies, CA and keys in ./certs, the file secret store).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from gateway import __version__
from gateway.config import ConfigError
from gateway.net.ca import CAError
from gateway.services.identity.claims import TokenError
from gateway.services.policy import PolicyError

__all__ = ["GROUPS", "build_parser", "main"]

# The command groups' modules (gateway/cli/<name>.py), in the order of the help text.
GROUPS = ("run", "token", "config", "policy", "presets", "ca", "env", "usage", "state",
          "approvals", "mcp_oauth")


def build_parser(groups: tuple[str, ...] = GROUPS) -> argparse.ArgumentParser:
    """The command line's parser, with the commands of `groups` (default: all)."""
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand's own --config default must not erase one given before it.
    common.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help="gateway.yaml (default: built-in)")
    parser = argparse.ArgumentParser(
        prog="sandbox-gateway", description="Secrets-and-egress gateway for AI sandboxes.",
        parents=[common])
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)

    for group in groups:
        importlib.import_module(f"gateway.cli.{group}").register(sub, common)
    return parser


def main(argv: list[str] | None = None, groups: tuple[str, ...] = GROUPS) -> int:
    """Run the command `argv` names (`groups`: the command groups to know; `__main__`
    gives `run` alone for `run`)."""
    args = build_parser(groups).parse_args(argv)
    try:
        return int(args.func(args))
    except (ConfigError, PolicyError, TokenError, CAError) as exc:
        errors = getattr(exc, "errors", None)
        if errors:
            for error in errors:
                print(error, file=sys.stderr)
        else:
            print(f"sandbox-gateway: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
