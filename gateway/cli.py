"""`sandbox-gateway` (also `python -m gateway`): run, token, config, policy, ca, env,
node-preload, usage, state.

`policy` has check, explain [--resolve], test [--junit] and diff --base [--replay]; the
logic lives in gateway/services/policy/ (testing, diff, report, revision) and
gateway/tools/explain.py, this module only reads arguments and files.

Every subcommand takes `--config FILE`; without it the embedded defaults apply
(policies from ./policies, CA and keys in ./certs, the file secret store).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import logging
import os
import signal
import sqlite3
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway import __version__
from gateway.config import Config, ConfigError, load_config, parse_duration
from gateway.net import ca
from gateway.services.identity.tokens import SigningKeys, TokenError, TokenService, parse_scope
from gateway.services.policy import PolicyError, PolicySet, load_policy_dir, policy_files
from gateway.services.policy.loader import outside_error, resolves_outside, source_name
from gateway.services.state.base import MemoryState

if TYPE_CHECKING:
    from gateway.services.metering import Metering


def _config(args: argparse.Namespace) -> Config:
    return load_config(getattr(args, "config", None))


def cmd_run(args: argparse.Namespace) -> int:
    cfg = _config(args)
    from gateway.observability.logs import configure

    configure(cfg.log_level)  # every handler redacts secrets and tokens (observability/logs.py)
    if args.worker_index is None:  # once, not per worker
        from gateway.tools.config_check import config_warnings

        for warning in config_warnings(cfg):
            logging.getLogger("sandbox_gateway").warning("%s", warning)
    workers = args.workers if args.workers is not None else cfg.workers
    if workers == 0:
        from gateway.runtime.workers import available_cpus

        workers = available_cpus()
    if args.worker_index is None and workers > 1:
        from gateway.runtime.workers import run_supervisor

        return run_supervisor(cfg, getattr(args, "config", None), workers)
    if args.supervisor is not None:
        from gateway.runtime.workers import follow_supervisor

        follow_supervisor(args.supervisor)
    return _run_single(cfg, args.worker_index)


def _run_single(cfg: Config, worker: int | None) -> int:
    """One gateway process (alone, or worker `worker` of a supervisor)."""
    from gateway.net.resolver import new_event_loop
    from gateway.runtime.app import Gateway, StartupError

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
            print(f"sandbox-gateway: draining (at most {cfg.shutdown.drain:g}s; a second "
                  "signal stops at once)", file=sys.stderr)
        drain = loop.create_task(gateway.drain())
        stop.clear()
        waiter = loop.create_task(stop.wait())
        await asyncio.wait({drain, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        drain.cancel()
        await gateway.stop()
        return 0

    return asyncio.run(main(), loop_factory=new_event_loop)


def _banner(gateway: object) -> None:
    from gateway.runtime.app import Gateway

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
        f"  limits  {gateway.fd_limit} open files -> at most {gateway.gate.max_connections} "
        f"connections, {cfg.limits.connections_per_sandbox} per sandbox",
    ]
    if gateway.dns is not None:
        lines.insert(3, f"  dns     {_fmt(gateway.dns.addresses[0])}   (udp+tcp; registered "
                        "sandboxes only)")
    lines.append(ca.admin_token_line(cfg.certs, bool(cfg.admin_token),
                                        gateway.admin_token_created))
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
    keys = _signing_keys(cfg, init=args.init)
    service = TokenService(
        keys, MemoryState(), lambda name: _credentials(policies, name),
        issuer=cfg.tokens.issuer, default_ttl=cfg.tokens.default_ttl,
        max_ttl=cfg.tokens.max_ttl, max_lifetime=cfg.tokens.max_lifetime,
    )
    scope = parse_scope(args.scope) if args.scope else None
    ttl = parse_duration(args.ttl, "--ttl") if args.ttl else None
    lifetime = parse_duration(args.lifetime, "--lifetime") if args.lifetime else None
    minted = service.mint(args.sandbox, args.policy, scope, ttl=ttl, lifetime=lifetime,
                          cidr=args.bind_cidr or ())
    if args.json:
        print(json.dumps({"token": minted.token, "jti": minted.jti,
                          "expires_at": minted.expires_at}))
    else:
        print(minted.token)
    return 0


def _credentials(policies: PolicySet, name: str) -> list[str] | None:
    policy = policies.get(name)
    return None if policy is None else policy.credential_names


def _signing_keys(cfg: Config, *, init: bool = False) -> SigningKeys:
    """The gateway's signing keys, as the config names them. Never creates a key unless
    `init`: a key made in the wrong directory signs tokens the gateway refuses."""
    try:
        return SigningKeys.load(cfg.signing_dir, retired=cfg.tokens.retired_kids,
                                create=init)
    except TokenError:
        if init or any(cfg.signing_dir.glob("*.pem")):
            raise
    raise TokenError(
        f"no signing key in {cfg.signing_dir} (certs: {cfg.certs}, config: {cfg.source}); "
        "a gateway creates its keys on first start: pass the --config the gateway runs "
        "with (or run where its certs directory is), or --init to create a new key here "
        "(only a gateway using this directory accepts its tokens)")


def cmd_token_rotate(args: argparse.Namespace) -> int:
    from gateway.services.identity.keywatch import PICKUP_SECONDS

    cfg = _config(args)
    keys = _signing_keys(cfg)
    kid = keys.add_new()
    print(f"new signing key {kid} in {cfg.signing_dir}: a running gateway using this "
          f"directory signs with it within {PICKUP_SECONDS} seconds (no restart), and keeps "
          "verifying the older keys until they are retired (`token retire-key KID`, or "
          "tokens.retired_kids at the next start).")
    return 0


def cmd_token_retire(args: argparse.Namespace) -> int:
    from gateway.services.identity.keywatch import PICKUP_SECONDS

    cfg = _config(args)
    keys = _signing_keys(cfg)
    moved = keys.retire(args.kid)
    print(f"retired signing key {args.kid} (moved to {moved}): a running gateway using "
          f"{cfg.signing_dir} refuses the tokens it signed within {PICKUP_SECONDS} seconds.")
    return 0


def cmd_config_check(args: argparse.Namespace) -> int:
    """Validate the config, say where its files are and warn about risky settings."""
    from gateway.tools.config_check import config_warnings

    cfg = _config(args)
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


def cmd_policy_check(args: argparse.Namespace) -> int:
    directory = Path(args.dir) if args.dir else _config(args).policies
    try:
        policy_set = load_policy_dir(directory)
    except PolicyError as exc:
        for error in exc.errors:
            print(error, file=sys.stderr)
        print(f"{len(exc.errors)} error(s) in {directory}", file=sys.stderr)
        return 1
    if args.secrets:
        problems = _secret_problems(args, policy_set)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print(f"{len(problems)} secret problem(s)", file=sys.stderr)
            return 1
    print(f"{directory}: {len(policy_set.policies)} policies, {policy_set.rule_count} rules, "
          f"{len(policy_set.credentials)} credentials"
          f"{' (their secrets present)' if args.secrets else ''}: OK")
    return 0


def _secret_problems(args: argparse.Namespace, policy_set: PolicySet) -> list[str]:
    """`policy check --secrets`: the secrets credentials name, read from the store."""
    from gateway.services.minting.check import check_secrets
    from gateway.services.secrets import build_store

    cfg = _config(args)

    async def run() -> list[str]:
        store = build_store(cfg.secrets)
        try:
            return await check_secrets(policy_set, store)
        finally:
            await store.close()

    return asyncio.run(run())


def cmd_policy_explain(args: argparse.Namespace) -> int:
    from gateway.tools.explain import explain_body, explain_request, guard_from_config

    cfg = _config(args) if args.resolve or not args.dir else None
    directory = Path(args.dir) if args.dir else _config(args).policies if cfg is None \
        else cfg.policies
    try:
        policy_set = load_policy_dir(directory)
        guard = guard_from_config(cfg) if args.resolve and cfg is not None else None
        text = args.body
        if text is not None and text.startswith("@"):
            text = Path(text[1:]).read_text(encoding="utf-8")
        body = explain_body(text, args.model)
        answer = asyncio.run(explain_request(policy_set, args.policy, args.method, args.url,
                                             guard, body, _static_metering(args)))
    except OSError as exc:  # an unreadable --body @FILE
        print(f"sandbox-gateway: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # unknown policy, unusable URL: neither allow (0) nor deny (1)
        print(f"sandbox-gateway: {exc}", file=sys.stderr)
        return 2
    decision = answer.decision
    print(f"decision: {answer.result}")
    print(f"reason:   {answer.reason}")
    rule = decision.rule
    print(f"rule:     {f'{rule.source} ({rule.describe()})' if rule else '-'}")
    if decision.credential:
        print(f"inject:   credential {decision.credential}")
        if rule is not None and rule.models:
            print(f"models:   {', '.join(rule.models)}")
        if not answer.metered:
            print("metering: not checked: give the request's --body (or --model) to check "
                  "its model and what the metering step refuses")
        for budget in policy_set.policies[args.policy].budgets:
            if budget.applies_to(decision.credential):
                print(f"budget:   {budget.describe()} ({budget.source})")
    if answer.error:
        print(f"error:    {answer.error}")
    if args.resolve:
        destination = answer.destination
        if destination is None:
            print("destination: not checked (the policy denies; the gateway does not resolve "
                  "a denied host)")
        else:
            if answer.result != decision.result:
                print(f"policy:   {decision.result} ({decision.reason})")
            cls = f" [{destination.address_class}]" if destination.address_class else ""
            if destination.allowed:
                print(f"destination: allowed: {destination.reason}{cls}")
            else:
                print(f"destination: refused ({destination.code}){cls}; see reason")
    return 0 if answer.result != "deny" else 1


def _test_files(directory: Path) -> list[Path]:
    tests = directory / "tests"
    if not tests.is_dir():
        return []
    return sorted(p for p in tests.iterdir()
                  if p.suffix in (".yaml", ".yml") and not p.name.startswith(".") and p.is_file())


def _static_metering(args: argparse.Namespace) -> Metering:
    """The metering step `policy test` decides with: the gateway's (its pricing, for
    cost budgets) over empty counters; without a readable config, no pricing."""
    from gateway.core.evaluate import static_metering
    from gateway.services.metering import load_pricing

    try:
        pricing = _config(args).metering.pricing
        return static_metering(load_pricing(pricing) if pricing is not None else None)
    except Exception as exc:  # (ConfigError, PricingError, OSError): decided without prices
        print(f"note: no pricing for cost budgets ({exc})", file=sys.stderr)
    return static_metering()


def cmd_policy_test(args: argparse.Namespace) -> int:
    from gateway.services.policy.report import junit_xml, test_text
    from gateway.services.policy.testing import parse_cases, run_case

    directory = Path(args.dir) if args.dir else _config(args).policies
    try:
        policy_set = load_policy_dir(directory)
    except PolicyError as exc:
        for error in exc.errors:
            print(error, file=sys.stderr)
        print(f"{len(exc.errors)} error(s) in {directory}: fix the policies first",
              file=sys.stderr)
        return 2
    files = _test_files(directory)
    if not files:
        print(f"{directory / 'tests'}: no test files (*.yaml); see `policy test` in "
              "docs/policies.md", file=sys.stderr)
        return 2
    cases, errors = [], []
    for file in files:
        outside = resolves_outside(directory, file)
        if outside is not None:  # test files stay inside the policies directory too
            errors.append(f"{source_name(directory)}/tests/{file.name}:1: "
                          + outside_error(f"tests/{file.name}", outside, directory))
            continue
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            errors.append(f"{file}:1: cannot read: {exc}")
            continue
        found, problems = parse_cases(str(file), text)
        cases.extend(found)
        errors.extend(problems)
    if errors:
        for error in errors:
            print(error, file=sys.stderr)
        print(f"{len(errors)} error(s) in test files", file=sys.stderr)
        return 2
    metering = _static_metering(args)
    results, seconds = [], []
    for case in cases:
        started = time.perf_counter()
        results.append(run_case(policy_set, case, str(directory), metering))
        seconds.append(time.perf_counter() - started)
    print(f"policies: {directory} (revision {policy_set.revision})")
    print(test_text(results, len(files)))
    if args.junit:
        Path(args.junit).write_text(junit_xml(results, seconds), encoding="utf-8")
    return 0 if all(r.passed for r in results) else 1


def _audit_lines(paths: list[str]) -> Iterator[bytes]:
    """Every line of every audit file (``-`` = stdin, ``.gz`` decompressed), streamed."""
    for name in paths:
        if name == "-":
            yield from sys.stdin.buffer
            continue
        opener = gzip.open if name.endswith(".gz") else open
        with opener(name, "rb") as handle:
            yield from handle


def cmd_policy_diff(args: argparse.Namespace) -> int:
    from gateway.services.policy.diff import diff_sets
    from gateway.services.policy.replay import replay
    from gateway.services.policy.report import diff_json, diff_markdown, diff_text
    from gateway.services.policy.revision import GitRefError, export_ref

    if args.fail_on in ("newly-denied", "newly-allowed") and not args.replay:
        print(f"sandbox-gateway: --fail-on {args.fail_on} needs --replay AUDIT.jsonl "
              "(newly denied/allowed requests come from replaying recorded traffic)",
              file=sys.stderr)
        return 2
    directory = Path(args.dir) if args.dir else _config(args).policies
    with tempfile.TemporaryDirectory(prefix="sandbox-gateway-base-") as tmp:
        try:
            head = load_policy_dir(directory)
            base_dir, base_revision, exists = Path(args.base), None, True
            if not base_dir.is_dir():
                base_revision, exists = export_ref(directory, args.base, tmp)
                base_dir = Path(tmp)
            if base_revision is not None and not (exists and policy_files(base_dir)):
                base = PolicySet(policies={}, credentials={}, revision=base_revision)
            else:
                base = load_policy_dir(base_dir)
        except (PolicyError, GitRefError) as exc:
            for error in getattr(exc, "errors", None) or [str(exc)]:
                print(error, file=sys.stderr)
            return 2
        diff = diff_sets(base, head, base_root=str(base_dir), head_root=str(directory),
                         base_label=args.base, head_label=str(directory),
                         base_revision=base_revision)
        report = None
        if args.replay:
            try:
                report = replay(_audit_lines(args.replay), base, head,
                                base_root=str(base_dir), head_root=str(directory))
            except OSError as exc:
                print(f"sandbox-gateway: cannot read audit lines: {exc}", file=sys.stderr)
                return 2
    render = {"text": diff_text, "json": diff_json, "markdown": diff_markdown}[args.format]
    print(render(diff, report))
    failed = {
        None: False,
        "newly-denied": report is not None and bool(report.groups("newly_denied")),
        "newly-allowed": report is not None and bool(report.groups("newly_allowed")),
        "any": not diff.empty or (report is not None and report.changed),
    }[args.fail_on]
    return 1 if failed else 0


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
    from gateway.tools.sandbox_env import InvalidToken, dns_note, render, sandbox_variables

    try:
        verified = _check_env_token(args)
    except InvalidToken as exc:
        print(f"sandbox-gateway: --token is not a usable gateway token: {exc}; mint one "
              "with `sandbox-gateway token mint` or POST /v1/tokens", file=sys.stderr)
        return 1
    preload = None if args.node_preload in ("", "none") else args.node_preload
    variables = sandbox_variables(args.token, args.proxy, sandbox=args.sandbox,
                                  ca_bundle=args.ca_bundle, node_preload=preload,
                                  git_hosts=tuple(args.git_host or ["github.com"]))
    sys.stdout.write(render(variables, args.format))
    # The env file stays variables only; advice goes to the operator's terminal.
    notes = dns_note(args.proxy)
    if not verified:
        notes.append("# The token's signature was not checked (pass --config of the gateway "
                     "to check it against its signing keys).")
    if preload:
        notes.append(f"# NODE_OPTIONS loads {preload}: put it there in the image "
                     "(`sandbox-gateway node-preload -o FILE`).")
    notes.append("# aiohttp reads the proxy variables only with ClientSession(trust_env=True).")
    print("\n".join(notes), file=sys.stderr)
    return 0


def _check_env_token(args: argparse.Namespace) -> bool:
    """Refuse a token that is not a live gateway JWT; with --config also check its
    signature and policy against the gateway's keys. True when the signature was checked."""
    from gateway.services.identity.tokens import TokenRefused
    from gateway.tools.sandbox_env import InvalidToken, check_token

    check_token(args.token)
    if getattr(args, "config", None) is None:
        return False
    cfg = _config(args)
    keys = SigningKeys.load(cfg.signing_dir, retired=cfg.tokens.retired_kids, create=False)
    policies = load_policy_dir(cfg.policies)
    service = TokenService(keys, MemoryState(), lambda name: _credentials(policies, name),
                           issuer=cfg.tokens.issuer, leeway=cfg.tokens.leeway)
    try:
        service.verify(args.token)
    except TokenRefused as exc:
        raise InvalidToken(f"{exc.code}: {exc.reason}") from None
    return True


def cmd_node_preload(args: argparse.Namespace) -> int:
    from gateway.tools.sandbox_env import node_preload_source

    source = node_preload_source()
    if args.output in (None, "-"):
        sys.stdout.write(source)
        return 0
    target = Path(args.output)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(source, encoding="utf-8")
    target.chmod(0o644)
    print(f"wrote {target}; load it with NODE_OPTIONS=--import={target} "
          "(`sandbox-gateway env --node-preload PATH` prints that)", file=sys.stderr)
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
        reserved = b.get("reserved") or {}
        parts = []
        for kind, limit in limits.items():
            held = reserved.get(kind) or 0
            if kind == "cost_usd":
                part = f"{kind} {used[kind]:,.2f}" + (f" (+{held:,.2f} reserved)" if held
                                                      else "") + f" of {limit:,.2f}"
            else:
                part = f"{kind} {used[kind]:,}" + (f" (+{held:,} reserved)" if held
                                                   else "") + f" of {limit:,}"
            parts.append(part)
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


def _state_file(args: argparse.Namespace) -> Path:
    state = _config(args).state
    if state.get("store", "sqlite") != "sqlite":
        raise ConfigError(f"state.store is {state.get('store')!r}: `state` works on the "
                          "SQLite file (for redis use its own tools, e.g. redis-cli --rdb)")
    return Path(str(state["path"]))


def cmd_state_check(args: argparse.Namespace) -> int:
    """Is the state file sound (integrity, schema, mode)? What does it hold?"""
    from gateway.services.state.sqlite import check_file, summary

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
    print("FAILED" if problems else "OK")
    return 1 if problems else 0


def cmd_state_backup(args: argparse.Namespace) -> int:
    """An online, consistent copy of the state file (the gateway may keep running)."""
    from gateway.services.state.sqlite import backup_file, check_file

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
    run.add_argument("--supervisor", type=int, default=None, help=argparse.SUPPRESS)
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

    config = sub.add_parser("config", help="check the configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    config_check = config_sub.add_parser(
        "check", parents=[common],
        help="validate the config, show where its files are, warn about risky settings")
    config_check.set_defaults(func=cmd_config_check)

    policy = sub.add_parser("policy", help="check, explain, test and diff policy files")
    psub = policy.add_subparsers(dest="policy_command", required=True)
    check = psub.add_parser("check", parents=[common], help="validate every policy file")
    check.add_argument("dir", nargs="?", help="policies directory (default: from config)")
    check.add_argument("--secrets", action="store_true",
                       help="also read every secret the credentials name from the configured "
                            "store and check its shape (values are never printed)")
    check.set_defaults(func=cmd_policy_check)
    expl = psub.add_parser("explain", parents=[common], help="the decision for one request")
    expl.add_argument("--policy", required=True)
    expl.add_argument("--dir", help="policies directory (default: from config)")
    expl.add_argument("--resolve", action="store_true",
                      help="also resolve the host and check the address like the proxy "
                           "(network.* from the config)")
    expl.add_argument("--body", help="the request body (JSON text, or @FILE): also run the "
                                     "metering step (model allowlists, metering)")
    expl.add_argument("--model", help='shorthand for --body \'{"model": MODEL}\'')
    expl.add_argument("method", help="HTTP method, or CONNECT for the tunnel-level decision")
    expl.add_argument("url")
    expl.set_defaults(func=cmd_policy_explain)
    test = psub.add_parser("test", parents=[common],
                           help="run the test cases in DIR/tests/*.yaml")
    test.add_argument("dir", nargs="?", help="policies directory (default: from config)")
    test.add_argument("--junit", metavar="FILE", help="also write JUnit XML to FILE")
    test.set_defaults(func=cmd_policy_test)
    diff = psub.add_parser("diff", parents=[common],
                           help="rule-level diff against a base, optionally replaying audit lines")
    diff.add_argument("--base", required=True, metavar="REF_OR_DIR",
                      help="a policies directory, or a git ref (the same directory at that "
                           "commit)")
    diff.add_argument("dir", nargs="?", help="proposed policies directory (default: from "
                                             "config)")
    diff.add_argument("--replay", nargs="+", action="extend", metavar="AUDIT.jsonl",
                      help="audit lines to decide under both sets (.gz ok, - = stdin)")
    diff.add_argument("--format", choices=("text", "json", "markdown"), default="text")
    diff.add_argument("--fail-on", choices=("newly-denied", "newly-allowed", "any"),
                      default=None, help="exit 1 when this happens (default: always exit 0)")
    diff.set_defaults(func=cmd_policy_diff)

    ca_p = sub.add_parser("ca", help="certificate authority")
    csub = ca_p.add_subparsers(dest="ca_command", required=True)
    init = csub.add_parser("init", parents=[common], help="create the CA")
    init.add_argument("--dir", help="directory (default: certs from config)")
    init.set_defaults(func=cmd_ca_init)

    env = sub.add_parser(
        "env", parents=[common], help="print a sandbox's environment",
        description="Print a sandbox's environment on stdout (dotenv KEY=value lines for "
                    "docker --env-file, shell exports, or a Kubernetes env: list), and on "
                    "stderr how to run the sandbox without a DNS resolver: a sandbox using "
                    "the proxy needs none (the gateway resolves names). The token must be a "
                    "live gateway token; with --config its signature is checked too.")
    env.add_argument("--token", required=True)
    env.add_argument("--proxy", required=True, help="gateway URL, e.g. http://gateway:8080")
    env.add_argument("--sandbox", help="sandbox id (default: the token's sub)")
    env.add_argument("--git-host", action="append", metavar="HOST",
                     help="a host whose git credential helper answers the token "
                          "(repeatable; default github.com; add a GitHub Enterprise host)")
    env.add_argument("--ca-bundle", default="/etc/sandbox-gateway/ca-bundle.pem",
                     help="path of the CA bundle inside the sandbox (the system bundle with "
                          "the gateway CA added)")
    env.add_argument("--node-preload", default="/etc/sandbox-gateway/node-proxy-preload.mjs",
                     metavar="PATH", help="path of the Node preload inside the sandbox, for "
                     "NODE_OPTIONS (write it with `node-preload`; 'none' to leave it out)")
    env.add_argument("--format", choices=("dotenv", "shell", "k8s"), default="dotenv",
                     help="dotenv (KEY=value, default), shell (export KEY='value') or k8s "
                          "(a container's env: list)")
    env.set_defaults(func=cmd_env)

    preload = sub.add_parser(
        "node-preload", help="write the Node preload that proxies fetch",
        description="Write the Node preload (node-proxy-preload.mjs) that makes Node's fetch "
                    "use HTTPS_PROXY (Node 20 ignores it), for a sandbox image; `env` points "
                    "NODE_OPTIONS at it.")
    preload.add_argument("-o", "--output", metavar="FILE", help="file to write (default: stdout)")
    preload.set_defaults(func=cmd_node_preload)

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

    state = sub.add_parser("state", help="check or back up the state file (SQLite)")
    ssub = state.add_subparsers(dest="state_command", required=True)
    scheck = ssub.add_parser("check", parents=[common],
                             help="integrity, schema version and mode of the state file, "
                                  "and what it holds (row counts, no values)")
    scheck.add_argument("file", nargs="?", help="a state file or backup (default: "
                                                "state.path from the config)")
    scheck.set_defaults(func=cmd_state_check)
    backup = ssub.add_parser("backup", parents=[common],
                             help="copy the state file online (the gateway keeps running)")
    backup.add_argument("file", help="the copy to write (mode 0600)")
    backup.add_argument("--force", action="store_true", help="replace an existing FILE")
    backup.set_defaults(func=cmd_state_backup)
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
