"""`sandbox-gateway` (also `python -m gateway`): run, token, policy, ca, env, usage.

Every subcommand takes `--config FILE`; without it the embedded defaults apply
(policies from ./policies, CA and keys in ./certs, the file secret store).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

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
        policy = load_policy_dir(directory).get(args.policy)
        for budget in policy.budgets if policy is not None else ():
            if budget.applies_to(decision.credential):
                print(f"budget:   {budget.describe()} ({budget.source})")
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
    from gateway.sandbox_env import sandbox_env

    for line in sandbox_env(args.token, args.proxy, sandbox=args.sandbox,
                            ca_bundle=args.ca_bundle):
        print(line)
    return 0


def _admin_url(args: argparse.Namespace) -> str:
    if args.admin:
        return str(args.admin).rstrip("/")
    admin = _config(args).listen.admin
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(admin.host, admin.host)
    return f"http://[{host}]:{admin.port}" if ":" in host else f"http://{host}:{admin.port}"


def _admin_token(args: argparse.Namespace) -> str:
    if args.token:
        return str(args.token)
    if os.environ.get("SANDBOX_GATEWAY_ADMIN_TOKEN"):
        return os.environ["SANDBOX_GATEWAY_ADMIN_TOKEN"]
    cfg = _config(args)
    if cfg.admin_token:
        return cfg.admin_token
    path = cfg.certs / ca.ADMIN_TOKEN
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"no admin token: pass --token, set SANDBOX_GATEWAY_ADMIN_TOKEN or "
                          f"admin_token, or make {path} readable ({exc.strerror})") from None


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
        parts = [f"{kind} {used[kind]:,.2f} of {limit:,.2f}" if kind == "cost_usd"
                 else f"{kind} {used[kind]:,} of {limit:,}" for kind, limit in limits.items()]
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
    url = _admin_url(args)
    query = {k: v for k, v in (("sandbox", args.sandbox), ("policy", args.policy),
                               ("since", args.since)) if v}
    target = f"{url}/v1/usage" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    request = urllib.request.Request(target, headers={  # noqa: S310 - operator-given URL
        "Authorization": f"Bearer {_admin_token(args)}", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:  # noqa: S310
            report = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read()).get("reason", "")
        except (ValueError, AttributeError):
            detail = ""
        print(f"sandbox-gateway: {target}: HTTP {exc.code} {detail}".rstrip(), file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        print(f"sandbox-gateway: cannot reach the admin API at {url}: {reason}",
              file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print("\n".join(_usage_lines(report)))
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

    env = sub.add_parser("env", parents=[common], help="print a sandbox's environment")
    env.add_argument("--token", required=True)
    env.add_argument("--proxy", required=True, help="gateway URL, e.g. http://gateway:8080")
    env.add_argument("--sandbox", help="sandbox id (default: the token's sub)")
    env.add_argument("--ca-bundle", default="/etc/sandbox-gateway/ca-bundle.pem",
                     help="path of the CA bundle inside the sandbox")
    env.set_defaults(func=cmd_env)

    usage = sub.add_parser("usage", parents=[common],
                           help="inference usage and budgets (from the admin API)")
    usage.add_argument("--sandbox", help="only this sandbox")
    usage.add_argument("--policy", help="only this policy (also shows its budgets)")
    usage.add_argument("--since", help="ISO 8601 time or duration back from now, e.g. 24h "
                       "(default: everything kept, metering.retention)")
    usage.add_argument("--admin", metavar="URL",
                       help="admin API URL (default: http://<listen.admin> from the config)")
    usage.add_argument("--token", help="admin token (default: SANDBOX_GATEWAY_ADMIN_TOKEN, "
                       "admin_token, or certs/admin-token)")
    usage.add_argument("--timeout", type=float, default=10.0, help=argparse.SUPPRESS)
    usage.add_argument("--json", action="store_true", help="print the JSON answer")
    usage.set_defaults(func=cmd_usage)
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
