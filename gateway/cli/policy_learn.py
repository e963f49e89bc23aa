"""`policy learn AUDIT.jsonl... [--from-state] [--replay] [--propose]`: the smallest policy
that allows recorded traffic (gateway/services/policy/learn.py), its replay proof
(learn_proof.py) and, in a git checkout, a branch carrying it (approvals/proposal.py's
`commit_file`, as `always` grants are proposed)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import difflib
import sqlite3
import sys
from pathlib import Path
from typing import Any

from gateway.cli.common import audit_lines, config_of

__all__ = ["cmd_policy_learn", "register_learn"]

_PAGE = 1000


async def _state_lines(args: argparse.Namespace, policy: str | None) -> list[str]:
    """The request log of the configured state store (what the console shows), oldest
    first."""
    from gateway.services.state.factory import build_state
    from gateway.services.state.log import LogQuery

    cfg = config_of(args)
    store = build_state(cfg.state)
    lines: list[str] = []
    await store.start()
    try:
        before: str | None = None
        while True:
            page = await store.log_read(LogQuery(policy=policy or ""), _PAGE, before=before)
            lines.extend(entry.line for _, entry in page)
            if len(page) < _PAGE:
                break
            before = page[-1][0]
    finally:
        await store.close()
    lines.reverse()
    return lines


def cmd_policy_learn(args: argparse.Namespace) -> int:
    from gateway.services.approvals.proposal import commit_file
    from gateway.services.policy import PolicyError
    from gateway.services.policy.learn import learn, read_lines
    from gateway.services.policy.learn_io import head_set, policy_file, preset_sets
    from gateway.services.policy.learn_proof import prove

    raw: list[Any] = []
    try:
        raw.extend(audit_lines(args.audit))
    except OSError as exc:
        print(f"sandbox-gateway: cannot read audit lines: {exc}", file=sys.stderr)
        return 2
    if args.from_state:
        from gateway.services.state.base import StateUnavailable

        try:
            raw.extend(asyncio.run(_state_lines(args, args.policy)))
        except (StateUnavailable, OSError, ValueError, sqlite3.Error) as exc:
            print(f"sandbox-gateway: cannot read the state store's request log: {exc}",
                  file=sys.stderr)
            return 2
    records, bad = read_lines(raw)
    policies = sorted({r["policy"] for r in records if isinstance(r.get("policy"), str)})
    policy = args.policy or (policies[0] if len(policies) == 1 else None)
    if policy is None:
        print("sandbox-gateway: the lines name " + (", ".join(policies) or "no policy") +
              "; say which to learn with --policy NAME", file=sys.stderr)
        return 2
    directory = Path(args.dir) if args.dir else config_of(args).policies
    file, original = policy_file(directory, policy)
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    learned = learn(records, policy, presets=preset_sets(), original=original,
                    description=f"learned by sandbox-gateway policy learn on {today}")
    if args.out:
        Path(args.out).write_text(learned.text, encoding="utf-8")
    else:
        sys.stdout.write(learned.text)
    info = [f"learned {policy} from {len(learned.learned)} lines ({len(learned.refused)} "
            f"refused lines left out, {learned.skipped + bad} unreadable)"]
    info += [f"  {host}: {how}" for host, how in learned.hosts.items()]
    info += [f"note: {n}" for n in learned.notes]
    status = 0
    if args.replay:
        try:
            head = head_set(directory, file, learned.text)
        except PolicyError as exc:
            info += [f"the learned policy does not load: {e}" for e in exc.errors]
            print("\n".join(info), file=sys.stderr)
            return 1
        proof = prove(learned, head)
        info += proof.lines()
        status = 0 if proof.ok else 1
    if args.propose:
        patch = Path(args.patch_dir) / f"learned-{policy}.patch"
        patch.parent.mkdir(parents=True, exist_ok=True)
        patch.write_text("".join(difflib.unified_diff(
            (original or "").splitlines(keepends=True), learned.text.splitlines(keepends=True),
            f"a/{file}", f"b/{file}")), encoding="utf-8")
        info.append(f"patch: {patch}")
        branch_name = f"sandbox-gateway/learned-{policy}-{today}"
        try:
            branch = commit_file(directory, file, lambda _: learned.text, branch_name,
                                 f"Learned policy {policy}\n\nFrom {len(learned.learned)} "
                                 f"audit lines by sandbox-gateway policy learn on {today}.")
        except (OSError, ValueError) as exc:
            info.append(f"no branch: {exc}")
            status = status or 1
        else:
            info.append(f"branch: {branch}" if branch else
                        f"no branch: {directory} is not in a git checkout")
    print("\n".join(info), file=sys.stderr)
    return status


def register_learn(psub: argparse._SubParsersAction[argparse.ArgumentParser],
                   common: argparse.ArgumentParser) -> None:
    """Add `policy learn` to the `policy` command's parser."""
    learn = psub.add_parser("learn", parents=[common],
                            help="the smallest policy that allows recorded traffic")
    learn.add_argument("audit", nargs="*", metavar="AUDIT.jsonl",
                       help="audit files (- = stdin, .gz read)")
    learn.add_argument("--from-state", "--console", dest="from_state", action="store_true",
                       help="also read the request log of the configured state store (the "
                            "console's)")
    learn.add_argument("--policy", help="the policy to learn (default: the lines' only one)")
    learn.add_argument("--dir", help="policies directory (default: from config)")
    learn.add_argument("--out", metavar="FILE", help="write the policy there (default: stdout)")
    learn.add_argument("--replay", action="store_true",
                       help="prove it: every learned line allowed, no refused one, probes")
    learn.add_argument("--propose", action="store_true",
                       help="write a patch and, in a git checkout, a branch with the file")
    learn.add_argument("--patch-dir", default=".", metavar="DIR",
                       help="where --propose writes the patch (default: .)")
    learn.set_defaults(func=cmd_policy_learn)
