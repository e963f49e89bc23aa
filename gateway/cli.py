"""`sandbox-gateway` (also `python -m gateway`): run, token, policy, ca, env.

Every subcommand takes `--config FILE`; without it the embedded defaults apply
(policies from ./policies, CA and keys in ./certs, the file secret store).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

from gateway import __version__, ca
from gateway.config import Config, ConfigError, load_config, parse_duration
from gateway.policy import PolicyError, PolicySet, explain, load_policy_dir
from gateway.state import MemoryState
from gateway.tokens import SigningKeys, TokenError, TokenService, parse_scope


def _config(args: argparse.Namespace) -> Config:
    return load_config(getattr(args, "config", None))


def cmd_run(args: argparse.Namespace) -> int:
    cfg = _config(args)
    logging.basicConfig(
        level=getattr(logging, cfg.log_level.upper()), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("mitmproxy").setLevel(logging.WARNING)
    workers = args.workers if args.workers is not None else cfg.workers
    if workers == 0:
        from gateway.workers import available_cpus

        workers = available_cpus()
    if args.worker_index is None and workers > 1:
        from gateway.workers import run_supervisor

        return run_supervisor(cfg, getattr(args, "config", None), workers)
    return _run_single(cfg, args.worker_index)


def _run_single(cfg: Config, worker: int | None) -> int:
    """One gateway process (alone, or worker `worker` of a supervisor)."""
    from gateway.app import Gateway, StartupError
    from gateway.resolver import new_event_loop

    async def main() -> int:
        gateway = Gateway(cfg, worker=worker)
        try:
            await gateway.start()
        except StartupError as exc:
            print(f"sandbox-gateway: {exc}", file=sys.stderr)
            return 2
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if worker is None:
            _banner(gateway)
        else:
            assert cfg.runtime_dir is not None
            (cfg.runtime_dir / f"ready-{worker}").touch()
        await stop.wait()
        if worker is None:
            print("sandbox-gateway: shutting down", file=sys.stderr)
        await gateway.stop()
        return 0

    return asyncio.run(main(), loop_factory=new_event_loop)


def _banner(gateway: object) -> None:
    from gateway.app import Gateway

    assert isinstance(gateway, Gateway)
    cfg = gateway.config
    assert gateway.proxy_address and gateway.admin_address
    lines = [
        f"sandbox-gateway {__version__} ready",
        f"  proxy   http://{_fmt(gateway.proxy_address)}   (HTTPS_PROXY for sandboxes)",
        f"  admin   http://{_fmt(gateway.admin_address)}   (/healthz /readyz /metrics /v1/...)",
        f"  CA      {cfg.certs / ca.CA_CERT}   (sandboxes must trust it)",
        f"  policies {cfg.policies} ({len(gateway.current_policies().policies)} loaded, "
        "hot-reloaded)",
    ]
    if gateway.dns is not None:
        lines.insert(3, f"  dns     {_fmt(gateway.dns.addresses[0])}   (udp+tcp; registered "
                        "sandboxes only)")
    if gateway.admin_token_created:
        lines.append(f"  admin token (generated, saved to {cfg.certs / ca.ADMIN_TOKEN}): "
                     f"{gateway.admin_token}")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _fmt(addr: tuple[str, int]) -> str:
    host, port = addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def cmd_token_mint(args: argparse.Namespace) -> int:
    cfg = _config(args)
    policies = load_policy_dir(cfg.policies)
    if policies.get(args.policy) is None:
        raise TokenError(f"policy {args.policy!r} does not exist in {cfg.policies}; "
                         f"known: {', '.join(sorted(policies.policies)) or 'none'}")
    keys = SigningKeys.load(cfg.signing_dir, retired=cfg.tokens.retired_kids)
    service = TokenService(
        keys, MemoryState(), lambda name: _credentials(policies, name),
        issuer=cfg.tokens.issuer, default_ttl=cfg.tokens.default_ttl,
        max_ttl=cfg.tokens.max_ttl, max_lifetime=cfg.tokens.max_lifetime,
    )
    scope = parse_scope(args.scope) if args.scope else None
    ttl = parse_duration(args.ttl, "--ttl") if args.ttl else None
    lifetime = parse_duration(args.lifetime, "--lifetime") if args.lifetime else None
    minted = service.mint(args.sandbox, args.policy, scope, ttl=ttl, lifetime=lifetime)
    if args.json:
        print(json.dumps({"token": minted.token, "jti": minted.jti,
                          "expires_at": minted.expires_at}))
    else:
        print(minted.token)
    return 0


def _credentials(policies: PolicySet, name: str) -> list[str] | None:
    policy = policies.get(name)
    return None if policy is None else policy.credential_names


def cmd_token_rotate(args: argparse.Namespace) -> int:
    cfg = _config(args)
    keys = SigningKeys.load(cfg.signing_dir, retired=cfg.tokens.retired_kids)
    kid = keys.add_new()
    print(f"new signing key {kid} in {cfg.signing_dir}; it signs after the next restart. "
          f"Old keys keep verifying until listed in tokens.retired_kids or deleted.")
    return 0


def cmd_policy_check(args: argparse.Namespace) -> int:
    directory = Path(args.dir) if args.dir else _config(args).policies
    try:
        policy_set = load_policy_dir(directory)
    except PolicyError as exc:
        for error in exc.errors:
            print(error, file=sys.stderr)
        print(f"{len(exc.errors)} error(s) in {directory}", file=sys.stderr)
        return 1
    print(f"{directory}: {len(policy_set.policies)} policies, {policy_set.rule_count} rules, "
          f"{len(policy_set.credentials)} credentials: OK")
    return 0


def cmd_policy_explain(args: argparse.Namespace) -> int:
    directory = Path(args.dir) if args.dir else _config(args).policies
    try:
        decision = explain(load_policy_dir(directory), args.policy, args.method, args.url)
    except ValueError as exc:  # unknown policy, unusable URL: neither allow (0) nor deny (1)
        print(f"sandbox-gateway: {exc}", file=sys.stderr)
        return 2
    print(f"decision: {decision.result}")
    print(f"reason:   {decision.reason}")
    rule = decision.rule
    print(f"rule:     {f'{rule.source} ({rule.describe()})' if rule else '-'}")
    if decision.credential:
        print(f"inject:   credential {decision.credential}")
    return 0 if decision.allowed else 1


def cmd_ca_init(args: argparse.Namespace) -> int:
    directory = Path(args.dir) if args.dir else _config(args).certs
    if (directory / ca.CA_CERT).exists() or (directory / ca.CA_KEY).exists():
        print(f"{directory} already holds a CA; remove ca.crt and ca.key to make a new one",
              file=sys.stderr)
        return 1
    cert, key = ca.create_ca(directory)
    print(f"CA certificate: {cert}\nCA key:         {key} (keep private)")
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from gateway.sandbox_env import dns_note, sandbox_env

    for line in sandbox_env(args.token, args.proxy, sandbox=args.sandbox,
                            ca_bundle=args.ca_bundle):
        print(line)
    # The env file stays KEY=value lines; the DNS advice goes to the operator's terminal.
    print("\n".join(dns_note(args.proxy)), file=sys.stderr)
    return 0


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

    run = sub.add_parser("run", parents=[common], help="start the gateway")
    run.add_argument("--workers", type=int, default=None, metavar="N",
                     help="worker processes sharing the ports (default: config workers; "
                          "0 = one per core)")
    run.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    run.set_defaults(func=cmd_run)

    token = sub.add_parser("token", help="mint tokens, rotate signing keys")
    tsub = token.add_subparsers(dest="token_command", required=True)
    mint = tsub.add_parser("mint", parents=[common], help="print a sandbox token (JWT)")
    mint.add_argument("--sandbox", required=True, help="sandbox id (the token's sub)")
    mint.add_argument("--policy", required=True, help="policy name (the token's pol)")
    mint.add_argument("--scope", action="append", help="credential[:path] (repeatable); "
                      "default: every credential the policy references")
    mint.add_argument("--ttl", help="lifetime of this token, e.g. 15m (max tokens.max_ttl)")
    mint.add_argument("--lifetime", help="max sandbox lifetime across refreshes, e.g. 8h")
    mint.add_argument("--json", action="store_true", help="print {token, jti, expires_at}")
    mint.set_defaults(func=cmd_token_mint)
    rotate = tsub.add_parser("rotate-key", parents=[common], help="add a new signing key")
    rotate.set_defaults(func=cmd_token_rotate)

    policy = sub.add_parser("policy", help="check and explain policy files")
    psub = policy.add_subparsers(dest="policy_command", required=True)
    check = psub.add_parser("check", parents=[common], help="validate every policy file")
    check.add_argument("dir", nargs="?", help="policies directory (default: from config)")
    check.set_defaults(func=cmd_policy_check)
    expl = psub.add_parser("explain", parents=[common], help="the decision for one request")
    expl.add_argument("--policy", required=True)
    expl.add_argument("--dir", help="policies directory (default: from config)")
    expl.add_argument("method")
    expl.add_argument("url")
    expl.set_defaults(func=cmd_policy_explain)

    ca_p = sub.add_parser("ca", help="certificate authority")
    csub = ca_p.add_subparsers(dest="ca_command", required=True)
    init = csub.add_parser("init", parents=[common], help="create the CA")
    init.add_argument("--dir", help="directory (default: certs from config)")
    init.set_defaults(func=cmd_ca_init)

    env = sub.add_parser(
        "env", parents=[common], help="print a sandbox's environment",
        description="Print a sandbox's environment (KEY=value lines, for docker --env-file) "
                    "on stdout, and on stderr how to run the sandbox without a DNS resolver: "
                    "a sandbox using the proxy needs none (the gateway resolves names).")
    env.add_argument("--token", required=True)
    env.add_argument("--proxy", required=True, help="gateway URL, e.g. http://gateway:8080")
    env.add_argument("--sandbox", help="sandbox id (default: the token's sub)")
    env.add_argument("--ca-bundle", default="/etc/sandbox-gateway/ca-bundle.pem",
                     help="path of the CA bundle inside the sandbox")
    env.set_defaults(func=cmd_env)
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
