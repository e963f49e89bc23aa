"""`token`: mint sandbox tokens, rotate and retire signing keys."""

from __future__ import annotations

import argparse
import json

from gateway.cli.common import config_of, credentials_of, signing_keys_of
from gateway.config import parse_duration
from gateway.services.identity.tokens import MintedToken, TokenError, TokenService, parse_scope
from gateway.services.policy import load_policy_dir
from gateway.services.state.base import MemoryState


def mint_token(args: argparse.Namespace, *, init: bool = False) -> MintedToken:
    """A token for `args.sandbox` and `args.policy` (with `args.ttl`, or the policy's
    `tokens: {ttl}`, or tokens.default_ttl), signed with the config's keys."""
    cfg = config_of(args)
    policies = load_policy_dir(cfg.policies)
    if policies.get(args.policy) is None:
        raise TokenError(f"policy {args.policy!r} does not exist in {cfg.policies}; "
                         f"known: {', '.join(sorted(policies.policies)) or 'none'}")
    keys = signing_keys_of(cfg, init=init)

    def policy_ttl(name: str) -> float | None:
        policy = policies.get(name)
        return None if policy is None else policy.token_ttl

    service = TokenService(
        keys, MemoryState(), lambda name: credentials_of(policies, name),
        issuer=cfg.tokens.issuer, default_ttl=cfg.tokens.default_ttl,
        max_ttl=cfg.tokens.max_ttl, max_lifetime=cfg.tokens.max_lifetime,
        policy_ttl=policy_ttl,
    )
    scope = parse_scope(args.scope) if getattr(args, "scope", None) else None
    ttl = parse_duration(args.ttl, "--ttl") if args.ttl else None
    lifetime = (parse_duration(args.lifetime, "--lifetime")
                if getattr(args, "lifetime", None) else None)
    return service.mint(args.sandbox, args.policy, scope, ttl=ttl, lifetime=lifetime,
                        cidr=getattr(args, "bind_cidr", None) or ())


def cmd_token_mint(args: argparse.Namespace) -> int:
    minted = mint_token(args, init=args.init)
    if args.json:
        print(json.dumps({"token": minted.token, "jti": minted.jti,
                          "expires_at": minted.expires_at}))
    else:
        print(minted.token)
    return 0


def cmd_token_rotate(args: argparse.Namespace) -> int:
    from gateway.services.identity.keywatch import PICKUP_SECONDS

    cfg = config_of(args)
    keys = signing_keys_of(cfg)
    kid = keys.add_new()
    print(f"new signing key {kid} in {cfg.signing_dir}: a running gateway using this "
          f"directory signs with it within {PICKUP_SECONDS} seconds (no restart), and keeps "
          "verifying the older keys until they are retired (`token retire-key KID`, or "
          "tokens.retired_kids at the next start).")
    return 0


def cmd_token_retire(args: argparse.Namespace) -> int:
    from gateway.services.identity.keywatch import PICKUP_SECONDS

    cfg = config_of(args)
    keys = signing_keys_of(cfg)
    moved = keys.retire(args.kid)
    print(f"retired signing key {args.kid} (moved to {moved}): a running gateway using "
          f"{cfg.signing_dir} refuses the tokens it signed within {PICKUP_SECONDS} seconds.")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser],
             common: argparse.ArgumentParser) -> None:
    """Add the `token` command to the parser."""
    token = sub.add_parser("token", help="mint tokens, rotate signing keys")
    tsub = token.add_subparsers(dest="token_command", required=True)
    mint = tsub.add_parser("mint", parents=[common], help="print a sandbox token (JWT)")
    mint.add_argument("--sandbox", required=True, help="sandbox id (the token's sub)")
    mint.add_argument("--policy", required=True, help="policy name (the token's pol)")
    mint.add_argument("--scope", action="append", help="credential[:path] (repeatable); "
                      "default: every credential the policy references")
    mint.add_argument("--ttl", help="lifetime of this token, e.g. 15m (default: the policy's "
                      "tokens.ttl, else tokens.default_ttl; max tokens.max_ttl)")
    mint.add_argument("--lifetime", help="max sandbox lifetime across refreshes, e.g. 8h")
    mint.add_argument("--bind-cidr", action="append", metavar="NET",
                      help="accept the token only from this source network, e.g. the "
                           "sandbox's 10.0.3.7/32 (repeatable): a leaked token is useless "
                           "from anywhere else")
    mint.add_argument("--json", action="store_true", help="print {token, jti, expires_at}")
    mint.add_argument("--init", action="store_true",
                      help="create a first signing key when the certs directory has none "
                           "(otherwise refused: the gateway would not know that key)")
    mint.set_defaults(func=cmd_token_mint)
    rotate = tsub.add_parser("rotate-key", parents=[common],
                             help="add a new signing key (a running gateway signs with it "
                                  "within seconds)")
    rotate.set_defaults(func=cmd_token_rotate)
    retire = tsub.add_parser("retire-key", parents=[common],
                             help="retire a signing key: tokens it signed stop verifying")
    retire.add_argument("kid", help="the key id (its file name without .pem)")
    retire.set_defaults(func=cmd_token_retire)
