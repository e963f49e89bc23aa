"""`token`: mint sandbox tokens, exchange a pod's service-account token for one, rotate
and retire signing keys."""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import sys
from pathlib import Path

from gateway.cli.common import config_of, credentials_of, signing_keys_of
from gateway.config import Config, parse_duration
from gateway.services.identity.claims import TokenError, parse_scope
from gateway.services.identity.tokens import MintedToken, TokenService
from gateway.services.policy import load_policy_dir
from gateway.services.state.base import MemoryState, StateUnavailable

RECORD_TIMEOUT = 10.0  # seconds to reach the state store to record a token


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
    minted = service.mint(args.sandbox, args.policy, scope, ttl=ttl, lifetime=lifetime,
                          cidr=getattr(args, "bind_cidr", None) or (),
                          user=getattr(args, "user", None))
    problem = record_minted(cfg, minted)
    if problem is not None:
        print(f"sandbox-gateway: token {minted.jti} is valid but not listed in the console "
              f"or GET /v1/tokens: {problem}", file=sys.stderr)
    return minted


def record_minted(cfg: Config, minted: MintedToken) -> str | None:
    """Record a token signed here in the gateway's state store (`identity/issued.py`),
    as the admin API records its own, so it is listed; why not, or None once recorded.
    A `memory` store lives in the gateway process only: nothing to record into."""
    from gateway.services.identity.issued import IssuedTokens
    from gateway.services.state.factory import build_state

    if cfg.state.get("store", "sqlite") == "memory":
        return None

    async def record() -> bool:
        state = build_state(cfg.state)
        try:
            await asyncio.wait_for(state.start(), RECORD_TIMEOUT)
            return await IssuedTokens(state).record(minted, "mint", hold=False)
        finally:
            await state.close()

    try:
        recorded = asyncio.run(record())
    except (StateUnavailable, OSError, ValueError, sqlite3.Error) as exc:  # (TimeoutError too)
        return f"the state store cannot be reached ({str(exc) or type(exc).__name__})"
    return None if recorded else "the state store cannot be written"


def cmd_token_mint(args: argparse.Namespace) -> int:
    minted = mint_token(args, init=args.init)
    if args.json:
        print(json.dumps({"token": minted.token, "jti": minted.jti,
                          "expires_at": minted.expires_at}))
    else:
        print(minted.token)
    return 0


PROJECTED_TOKEN = "/var/run/secrets/sandbox-gateway/token"


def cmd_token_exchange(args: argparse.Namespace) -> int:
    """From inside a pod: its projected service-account token (audience sandbox-gateway)
    for a gateway token bound to the pod (POST /v1/tokens/exchange on the admin listener);
    prints the token, or with --proxy the HTTPS_PROXY that carries it."""
    import urllib.error
    import urllib.request

    from gateway.tools.sandbox_env import proxy_url

    try:
        sa_token = Path(args.token_file).read_text(encoding="utf-8").strip()
    except OSError as exc:
        print(f"sandbox-gateway: cannot read the service-account token {args.token_file}: "
              f"{exc.strerror}; mount a projected serviceAccountToken volume there "
              "(audience sandbox-gateway)", file=sys.stderr)
        return 1
    body: dict[str, str] = {"token": sa_token}
    if args.ttl:
        body["ttl"] = args.ttl
    if not args.gateway.startswith(("http://", "https://")):
        print("sandbox-gateway: --gateway must be an http:// or https:// URL", file=sys.stderr)
        return 2
    request = urllib.request.Request(  # noqa: S310 (http(s) only, checked above)
        args.gateway.rstrip("/") + "/v1/tokens/exchange", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310
            got = json.load(response)
    except urllib.error.HTTPError as exc:
        try:
            error = json.load(exc)
            why = f"{error.get('error')}: {error.get('reason')}"
        except ValueError:
            why = str(exc.reason)
        print(f"sandbox-gateway: the gateway refused the exchange ({exc.code} {why})",
              file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"sandbox-gateway: cannot reach {args.gateway}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(got))
    elif args.proxy:
        url = proxy_url(args.proxy, str(got["sandbox"]), str(got["token"]))
        print(f"HTTPS_PROXY={url}\nHTTP_PROXY={url}")
    else:
        print(got["token"])
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
    mint.add_argument("--user", metavar="NAME",
                      help="the person the sandbox acts for (the token's usr claim): an MCP "
                           "OAuth rule with consent: user keeps one grant per user")
    mint.add_argument("--json", action="store_true", help="print {token, jti, expires_at}")
    mint.add_argument("--init", action="store_true",
                      help="create a first signing key when the certs directory has none "
                           "(otherwise refused: the gateway would not know that key)")
    mint.set_defaults(func=cmd_token_mint)
    exchange = tsub.add_parser(
        "exchange", help="from inside a pod: exchange its projected service-account token "
                         "for a gateway token bound to the pod (identity.kubernetes)")
    exchange.add_argument("--gateway", required=True, metavar="URL",
                          help="the gateway's admin listener, e.g. http://sandbox-gateway:8090")
    exchange.add_argument("--token-file", default=PROJECTED_TOKEN,
                          help=f"the projected token (default {PROJECTED_TOKEN})")
    exchange.add_argument("--ttl", help="a shorter lifetime, e.g. 30m (capped by "
                                        "identity.kubernetes.exchange.ttl)")
    exchange.add_argument("--proxy", metavar="URL", help="print HTTPS_PROXY/HTTP_PROXY for "
                          "this proxy URL with the token, instead of the bare token")
    exchange.add_argument("--json", action="store_true",
                          help="print {token, jti, expires_at, sandbox, policy}")
    exchange.set_defaults(func=cmd_token_exchange)
    rotate = tsub.add_parser("rotate-key", parents=[common],
                             help="add a new signing key (a running gateway signs with it "
                                  "within seconds)")
    rotate.set_defaults(func=cmd_token_rotate)
    retire = tsub.add_parser("retire-key", parents=[common],
                             help="retire a signing key: tokens it signed stop verifying")
    retire.add_argument("kid", help="the key id (its file name without .pem)")
    retire.set_defaults(func=cmd_token_retire)
