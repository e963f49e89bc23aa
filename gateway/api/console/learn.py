"""Learning a policy (`/console/learn?policy=NAME`): what `policy learn --from-state
--replay` gives, shown read-only — the policy learned from the request log's lines of that
policy (`services/policy/learn.py`), its replay proof (`learn_proof.py`), the rule-level
diff from the policies in force (`diff.py`) and the file's diff, with the command that
proposes it as a branch. Nothing is written from here: people review, then run it."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.api.console.site import Site
from gateway.core.policy import PolicySet
from gateway.services.state.base import StateUnavailable
from gateway.services.state.log import LogLines, LogQuery

__all__ = ["LIMIT", "routes"]

LIMIT = 20_000  # request-log lines read at most (newest), the page says so
_PAGE = 1000


async def _lines(log: LogLines, policy: str) -> list[str]:
    """The newest `LIMIT` lines of `policy` in the request log, oldest first."""
    lines: list[str] = []
    before: str | None = None
    while len(lines) < LIMIT:
        page = await log.log_read(LogQuery(policy=policy), _PAGE, before=before)
        lines.extend(entry.line for _, entry in page)
        if len(page) < _PAGE:
            break
        before = page[-1][0]
    lines.reverse()
    return lines[-LIMIT:]


def routes(site: Site, log: LogLines | None, policies: Callable[[], PolicySet],
           directory: Path | None) -> list[Route]:
    """The learn page."""

    @site.signed_in
    async def page(request: Request, nonce: str) -> Response:
        from gateway.services.policy import PolicyError
        from gateway.services.policy.diff import diff_sets
        from gateway.services.policy.learn import learn, read_lines
        from gateway.services.policy.learn_io import head_set, policy_file, preset_sets
        from gateway.services.policy.learn_proof import prove
        from gateway.services.policy.report import diff_text

        current = policies()
        names = sorted(n for n in current.policies if "/" not in n)
        chosen = request.query_params.get("policy", "")
        values: dict[str, object] = {"names": names, "chosen": chosen, "limit": LIMIT}
        problem, status = None, 200
        if log is None:
            problem = "The request log is off (console.retain 0): nothing to learn from here."
        elif chosen and chosen not in current.policies:
            problem = "No policy of that name is in force."
        elif chosen:
            try:
                raw = await _lines(log, chosen)
            except StateUnavailable as exc:
                raw, problem, status = [], f"The request log cannot be read: {exc}", 503
            records, _ = read_lines(raw)
            file, original = (policy_file(directory, chosen) if directory is not None
                              else (f"{chosen}.yaml", None))
            learned = learn(records, chosen, presets=preset_sets(), original=original,
                            description="learned in the console")
            values.update(lines=len(raw), learned=learned, file=file,
                          file_diff="".join(difflib.unified_diff(
                              (original or "").splitlines(keepends=True),
                              learned.text.splitlines(keepends=True),
                              f"a/{file}", f"b/{file}")))
            try:
                head = head_set(directory, file, learned.text)
            except PolicyError as exc:
                values["load_errors"] = exc.errors
            else:
                values["proof"] = prove(learned, head).lines()
                values["rule_diff"] = diff_text(diff_sets(
                    current, head, base_label="in force", head_label="learned"), None)
        return site.page(request, "learn.html", nonce, status, title="Learn a policy",
                         page="learn", problem=problem, **values)

    return [Route("/console/learn", page, methods=["GET"])]
