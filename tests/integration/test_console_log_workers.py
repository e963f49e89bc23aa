"""The console's request log on the real gateway with two worker processes on the
default SQLite state: every worker's lines in one page and one live stream, a refused
CONNECT shown live with its decision and today's explain, and the log kept across a
restart. Clients: httpx (the OpenAI SDK's transport) through the proxy, and httpx as
the operator's browser (cookie session; the browser itself: test_console_browser.py)."""

from __future__ import annotations

import json
import re
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.inference import FakeInference
from helpers.clients import open_tunnel
from helpers.process import ADMIN, GatewayProcess, start_with_provider
from helpers.redis_server import running_redis
from helpers.tls import LocalCA

KEY = "sk-fake-provider-key-console"
POLICY = """
version: v1
name: agent
egress:
  - host: api.openai.com
    credential: openai
credentials:
  openai: {preset: openai, secret: provider-key}
"""
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


def _start(workdir: Path, fake: FakeInference, test_ca: LocalCA, workers: int = 2,
           **extra: Any) -> GatewayProcess:
    return start_with_provider(workdir, fake, test_ca, key=KEY, policy=POLICY,
                               workers=workers, extra=extra)


def _console(gw: GatewayProcess) -> httpx.Client:
    browser = httpx.Client(base_url=f"http://127.0.0.1:{gw.admin}", timeout=10)
    signed = browser.post("/console/login", data={"token": ADMIN})
    assert signed.status_code == 303, signed.text
    return browser


def _watch(browser: httpx.Client, path: str, count: int) -> tuple[threading.Thread,
                                                                  list[dict[str, Any]]]:
    """A live stream read in a thread until `count` events came: the thread (started, the
    stream open) and the events as they arrive."""
    events: list[dict[str, Any]] = []
    opened = threading.Event()

    def watch() -> None:
        with browser.stream("GET", path, timeout=httpx.Timeout(10, read=30)) as stream:
            opened.set()
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                if len(events) >= count:
                    return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert opened.wait(10)
    return watcher, events


def _call(gw: GatewayProcess, token: str) -> int:
    """One chat completion on a new connection (the kernel picks the worker)."""
    with httpx.Client(proxy=f"http://sbx-1:{token}@127.0.0.1:{gw.proxy}", timeout=20,
                      verify=ssl.create_default_context(
                          cafile=str(gw.workdir / "certs" / "ca.crt"))) as http:
        return http.post("https://api.openai.com/v1/chat/completions", json=CHAT,
                         headers={"Authorization": f"Bearer {token}"}).status_code


def _refused(gw: GatewayProcess, token: str, host: str) -> None:
    with pytest.raises(ConnectionRefusedError, match="403"):
        open_tunnel(("127.0.0.1", gw.proxy), f"{host}:443", token, "sbx-1", timeout=5)


def _rows(html: str) -> list[str]:
    return re.findall(r'<td class="target">([^<]+)</td>', html)


def test_every_workers_lines_in_one_log_and_one_live_stream(
        tmp_path: Path, fake: FakeInference, test_ca: LocalCA) -> None:
    gw = _start(tmp_path / "gw", fake, test_ca)
    try:
        token = gw.token()
        browser = _console(gw)
        watcher, events = _watch(browser, "/console/requests/stream?decision=deny", 6)
        for _ in range(8):
            assert _call(gw, token) == 200
        for n in range(6):
            _refused(gw, token, f"evil-{n}.test")
        watcher.join(15)
        assert not watcher.is_alive(), f"only {len(events)} refusals streamed: {events}"
        # Every refusal, from whichever worker served it, in the one stream (in the order
        # the workers' batches reached the store: up to a batch apart from time order).
        assert sorted(str(e["host"]) for e in events) == [f"evil-{n}.test" for n in range(6)]
        assert all(e["error"] == "policy_denied" for e in events)
        audit = gw.audit_lines()
        assert {line["worker"] for line in audit} == {0, 1}, "both workers served"
        time.sleep(0.5)  # (the request log is written every 0.25 s)
        page = browser.get("/console/requests")
        assert page.status_code == 200
        shown = _rows(page.text)
        assert len(shown) == len(audit) == 14
        assert sum(r.startswith("api.openai.com:443/v1/chat") for r in shown) == 8
        assert KEY not in page.text and token not in page.text and ADMIN not in page.text
        # A refusal opens its decision, today's explain and what to change.
        ident = re.search(r'href="/console/requests/(\d+)"[^>]*>[^<]*</a></td>\s*<td>sbx-1</td>'
                          r'<td>agent</td><td>CONNECT</td>\s*<td class="target">evil-5', page.text)
        assert ident is not None, page.text
        detail = browser.get(f"/console/requests/{ident.group(1)}").text
        assert "evil-5.test" in detail and "policy_denied" in detail
        assert "What to change" in detail
        assert ("sandbox-gateway policy explain --policy=agent -- CONNECT "
                "https://evil-5.test:443") in detail
        assert "no rule" in detail
        allowed = browser.get("/console/requests?host=openai").text
        assert len(_rows(allowed)) == 8
        browser.close()
    finally:
        gw.stop()
    again = _start(tmp_path / "gw", fake, test_ca)  # the log is kept across a restart
    try:
        browser = _console(again)
        kept = _rows(browser.get("/console/requests").text)
        browser.close()
        assert len(kept) == 14
    finally:
        again.stop()


def test_a_watched_stream_does_not_hold_up_the_stop(
        tmp_path: Path, fake: FakeInference, test_ca: LocalCA) -> None:
    """A console left open on the live log: SIGTERM still stops the gateway at once (the
    stream ends within a poll), not after the stream's lifetime."""
    import signal

    gw = _start(tmp_path / "gw", fake, test_ca)
    try:
        browser = _console(gw)
        ended = threading.Event()

        def watch() -> None:
            with browser.stream("GET", "/console/requests/stream",
                                timeout=httpx.Timeout(10, read=60)) as stream:
                for _ in stream.iter_lines():
                    pass
            ended.set()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        time.sleep(1.0)
        started = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)
        gw.proc.wait(15)
        took = time.monotonic() - started
        assert ended.wait(5) and took < 5, f"stopped after {took:.1f}s"
        browser.close()
    finally:
        gw.stop()


def test_replicas_on_redis_share_one_log(tmp_path: Path, fake: FakeInference,
                                          test_ca: LocalCA) -> None:
    """Two replicas on one redis-server (`state.store: redis`): a refusal on either is in
    the other's page, and in a stream opened on the other."""
    for server in running_redis(tmp_path / "redis"):
        state = {"store": "redis", "url": server.url}
        one = _start(tmp_path / "one", fake, test_ca, workers=1, state=state)
        two = _start(tmp_path / "two", fake, test_ca, workers=1, state=state)
        try:
            browser, other = _console(two), _console(one)
            watcher, events = _watch(browser, "/console/requests/stream", 2)
            _refused(one, one.token(), "via-one.test")
            _refused(two, two.token(), "via-two.test")
            watcher.join(15)
            assert sorted(str(e["host"]) for e in events) == ["via-one.test", "via-two.test"]
            shown = _rows(other.get("/console/requests").text)
            assert sorted(shown) == ["via-one.test:443", "via-two.test:443"]
            browser.close()
            other.close()
        finally:
            one.stop()
            two.stop()
