"""`policy`: check, explain [--resolve], test [--junit], diff --base [--replay] and learn
(policy_learn.py).

The logic lives in gateway/services/policy/ (testing, diff, report, revision) and
gateway/tools/explain.py; this module only reads arguments and files."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.core.policy import PolicySet
from gateway.services.policy import PolicyError, load_policy_dir, policy_files
from gateway.services.policy.agents import preset_lines
from gateway.services.policy.loader import outside_error, resolves_outside, source_name

if TYPE_CHECKING:
    from gateway.services.metering import Metering

from gateway.cli.common import audit_lines as _audit_lines
from gateway.cli.common import config_of
from gateway.cli.policy_learn import register_learn
from gateway.core.policy.lint import outranked_credentials


def cmd_policy_check(args: argparse.Namespace) -> int:
    directory = Path(args.dir) if args.dir else config_of(args).policies
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
    for line in preset_lines(policy_set):
        print(line)
    warned: set[str] = set()  # (a rule inherited by several policies warns once)
    for policy in policy_set.policies.values():
        for warning in outranked_credentials(policy):
            if warning not in warned:
                warned.add(warning)
                print(warning, file=sys.stderr)
    return 0


def _secret_problems(args: argparse.Namespace, policy_set: PolicySet) -> list[str]:
    """`policy check --secrets`: the secrets credentials name, read from the store."""
    from gateway.services.minting.check import check_secrets
    from gateway.services.secrets import build_store

    cfg = config_of(args)

    async def run() -> list[str]:
        store = build_store(cfg.secrets)
        try:
            return await check_secrets(policy_set, store)
        finally:
            await store.close()

    return asyncio.run(run())


def cmd_policy_explain(args: argparse.Namespace) -> int:
    from gateway.tools.explain import explain_body, explain_request, guard_from_config

    cfg = config_of(args) if args.resolve or not args.dir else None
    directory = Path(args.dir) if args.dir else config_of(args).policies if cfg is None \
        else cfg.policies
    try:
        policy_set = load_policy_dir(directory)
        guard = guard_from_config(cfg) if args.resolve and cfg is not None else None
        text = args.body
        if text is not None and text.startswith("@"):
            text = Path(text[1:]).read_text(encoding="utf-8")
        body = explain_body(text, args.model, args.mcp, args.mcp_arguments)
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
    if rule is not None and rule.mcp is not None and args.mcp is None and args.body is None:
        print("mcp:      the calls are not checked: give --mcp METHOD[:NAME] (or the --body)")
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
    if answer.ask is not None:
        held = "a person is asked first" if answer.result != "deny" else \
            "the proxy asks a person instead of refusing"
        print(f"ask:      {held}: {answer.ask.describe()}, unless its destination, a key "
              "in it or a grant decides first")
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
    from gateway.services.metering import load_pricing, static_metering

    try:
        pricing = config_of(args).metering.pricing
        return static_metering(load_pricing(pricing) if pricing is not None else None)
    except Exception as exc:  # (ConfigError, PricingError, OSError): decided without prices
        print(f"note: no pricing for cost budgets ({exc})", file=sys.stderr)
    return static_metering()


def cmd_policy_test(args: argparse.Namespace) -> int:
    from gateway.services.policy.report import junit_xml, test_text
    from gateway.services.policy.testing import parse_cases, run_case

    directory = Path(args.dir) if args.dir else config_of(args).policies
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
    directory = Path(args.dir) if args.dir else config_of(args).policies
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


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser],
             common: argparse.ArgumentParser) -> None:
    """Add the `policy` command to the parser."""
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
    expl.add_argument("--mcp", metavar="METHOD[:NAME]",
                      help="an MCP call on a rule with mcp: (tools/call:search_issues, "
                           "resources/read:repo://org/x, prompts/get:review, tools/list)")
    expl.add_argument("--mcp-arguments", metavar="JSON",
                      help="with --mcp tools/call: the tool's arguments (a JSON object)")
    expl.add_argument("method", help="HTTP method, or CONNECT for the tunnel-level decision")
    expl.add_argument("url")
    expl.set_defaults(func=cmd_policy_explain)
    register_learn(psub, common)
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
