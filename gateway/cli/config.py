"""`config check`: validate the configuration and warn about risky settings."""

from __future__ import annotations

import argparse
from pathlib import Path

from gateway.cli.common import config_of
from gateway.net import ca
from gateway.services.identity.claims import TokenError
from gateway.services.identity.signing_keys import SigningKeys
from gateway.services.policy import PolicyError, load_policy_dir


def cmd_config_check(args: argparse.Namespace) -> int:
    """Validate the config, say where its files are and warn about risky settings."""
    from gateway.tools.config_check import config_warnings

    cfg = config_of(args)
    warnings = config_warnings(cfg)
    print(f"config: {cfg.source}")
    errors = 0
    try:
        policy_set = load_policy_dir(cfg.policies)
        print(f"  policies  {cfg.policies}: {len(policy_set.policies)} policies, "
              f"{policy_set.rule_count} rules")
    except PolicyError as exc:
        errors = len(exc.errors)
        print(f"  policies  {cfg.policies}: {errors} error(s) (see `policy check`)")
    has_ca = (cfg.certs / ca.CA_CERT).exists() and (cfg.certs / ca.CA_KEY).exists()
    print(f"  CA        {cfg.certs / ca.CA_CERT}: "
          f"{'present' if has_ca else 'missing (created at the first start)'}")
    try:
        keys = SigningKeys.load(cfg.signing_dir, retired=cfg.tokens.retired_kids,
                                create=False)
        print(f"  signing   {cfg.signing_dir}: {len(keys.active_kids())} key(s), signing "
              f"with {keys.signing_kid}")
    except TokenError:
        print(f"  signing   {cfg.signing_dir}: no key (created at the first start)")
    token_from = ("admin_token / SANDBOX_GATEWAY_ADMIN_TOKEN" if cfg.admin_token else
                  f"{cfg.certs / ca.ADMIN_TOKEN}" + ("" if (cfg.certs / ca.ADMIN_TOKEN).exists()
                                                    else " (generated at the first start)"))
    print(f"  admin     {cfg.listen.admin}, token from {token_from}")
    store = cfg.state.get("store", "sqlite")
    if store == "sqlite":
        path = Path(str(cfg.state["path"]))
        print(f"  state     sqlite {path}: " + ("present (`state check` checks it)"
                                                if path.exists()
                                                else "created at the first start"))
    else:
        print(f"  state     {store}")
    for warning in warnings:
        print(f"warning: {warning}")
    print(f"{'FAILED' if errors else 'OK'} ({len(warnings)} warning(s))")
    return 1 if errors else 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser],
             common: argparse.ArgumentParser) -> None:
    """Add the `config` command to the parser."""
    config = sub.add_parser("config", help="check the configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    config_check = config_sub.add_parser(
        "check", parents=[common],
        help="validate the config, show where its files are, warn about risky settings")
    config_check.set_defaults(func=cmd_config_check)
