"""The approvals service on real stores: two services on one SQLite file are two gateway
processes. One approval for the same thing asked twice (here or there), an answer given
on either releases both, a grant is live before anyone hears "approved", a timeout and
an answer race and exactly one wins."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.core import approvals as core
from gateway.core.approvals import Approval, Asked, Grant
from gateway.core.identity import Identity
from gateway.core.policy import Request
from gateway.core.policy.ask_rule import Ask
from gateway.net.resolver import new_event_loop
from gateway.services.approvals import ApprovalService, NotFound
from gateway.services.state.sqlite import SqliteState

ASKED = Asked("host", "new.test", 443)


def _request(asked: Asked = ASKED) -> Request:
    """The request held on `asked` (a tunnel to its host)."""
    return Request(None, "https", asked.host, asked.port, None)


def _identity(sandbox: str = "s1") -> Identity:
    return Identity(sandbox=sandbox, policy="agent", jti="j", scope={}, issued_at=0,
                    expires_at=time.time() + 600, lifetime_end=time.time() + 600)


def _run(scenario: Callable[[list[ApprovalService], list[dict[str, Any]]], Awaitable[None]],
         path: Path) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []

    async def main() -> None:
        stores = [SqliteState(path), SqliteState(path)]
        for store in stores:
            await store.start()
        try:
            await scenario([ApprovalService(s, audit=lines.append) for s in stores], lines)
        finally:
            for store in stores:
                await store.close()

    asyncio.run(main(), loop_factory=new_event_loop)  # type: ignore[arg-type]
    return lines


async def _pending(service: ApprovalService, count: int = 1) -> list[Any]:
    for _ in range(200):
        found = [a for a in await service.approvals() if a.state == "pending"]
        if len(found) >= count:
            return found
        await asyncio.sleep(0.01)
    raise AssertionError("nothing pending")


def test_one_approval_for_the_same_thing_answered_on_the_other_process(
        tmp_path: Path) -> None:
    async def scenario(services: list[ApprovalService], lines: list[Any]) -> None:
        one, two = services
        spec = Ask(hosts=True, timeout=10)
        waits = [asyncio.create_task(s.ask(_identity(), ASKED, "no rule", spec, request=_request()))
                 for s in (one, one, two)]
        other = asyncio.create_task(one.ask(_identity("s2"), ASKED, "no rule", spec,
                                              request=_request()))
        pending = await _pending(two, 2)
        mine = next(a for a in pending if a.sandbox == "s1")
        started = time.monotonic()
        answered, grant, _ = await two.answer(mine.id, "approve", scope="sandbox",
                                              duration="1h", by="alice")
        ended = await asyncio.gather(*waits)
        assert time.monotonic() - started < 1  # (polled every POLL seconds at most)
        assert all(isinstance(e, Approval) for e in ended)
        assert {e.id for e in ended} == {mine.id} and {e.state for e in ended} == {"approved"}
        assert grant is not None and answered.grant == grant.id
        assert not other.done()  # another sandbox's ask is its own
        request = Request("GET", "https", "new.test", 443, "/x")
        assert one.grant_for("s1", "agent", request) is None  # (until the refresh)
        assert await one.refresh() and one.grant_for("s1", "agent", request) == grant
        assert one.grant_for("s2", "agent", request) is None
        await one.answer(next(a for a in await one.approvals() if a.sandbox == "s2").id,
                         "deny", by="bob", note="no")
        assert (await other).state == "denied"  # type: ignore[union-attr]
        await one.revoke(grant.id, "carol")
        await two.refresh()
        assert not two.active(grant.id) and await two.grants() == []
        with pytest.raises(NotFound):
            await one.revoke(grant.id, "carol")

    lines = _run(scenario, tmp_path / "state.db")
    assert [line["decision"] for line in lines] == ["ask", "ask", "approve", "deny", "revoke"]
    assert all(line["engine"] == "approvals" for line in lines)


def test_a_grant_does_not_close_its_own_approval_before_its_answer_is_written(
        tmp_path: Path) -> None:
    """The answerer writes the grant, then the answer; another process that hears of the
    grant in between (at once, now that writes are noticed) lets its held request go but
    leaves the approval to the answer: closing it as "covered by grant" there failed the
    answer's write and expired the grant just made."""
    async def scenario(services: list[ApprovalService], lines: list[Any]) -> None:
        one, two = services
        spec = Ask(hosts=True, timeout=10)
        held = asyncio.create_task(one.ask(_identity(), ASKED, "no rule", spec,
                                           request=_request()))
        [pending] = await _pending(two)
        found = await one._read(pending.id)
        assert found is not None
        approval, rev = found
        _, grant = core.answer(approval, "approve", scope="sandbox", duration="1h",
                               by="alice", note=None, now=time.time())
        assert grant is not None
        await one._covered(approval, rev, grant)  # (heard between the two writes)
        assert await one._read(pending.id) == (approval, rev)
        answered, made, _ = await two.answer(pending.id, "approve", scope="sandbox",
                                             duration="1h", by="alice")
        assert answered.state == "approved" and answered.by == "alice" and made is not None
        assert not answered.note and two.active(made.id)
        assert isinstance(await held, Approval)

    _run(scenario, tmp_path / "state.db")


def test_a_timeout_and_a_late_answer_race_and_one_wins(tmp_path: Path) -> None:
    async def scenario(services: list[ApprovalService], lines: list[Any]) -> None:
        one, two = services
        ended = await one.ask(_identity(), ASKED, "no rule", Ask(hosts=True, timeout=0.3),
                              request=_request())
        assert isinstance(ended, Approval)
        assert ended.state == "timeout"
        with pytest.raises(ValueError, match="already answered"):
            await two.answer(ended.id, "approve", by="late")
        assert await two.grants() == []
        # The same thing asked again after a timeout: a new approval.
        again = asyncio.create_task(one.ask(_identity(), ASKED, "no rule",
                                            Ask(hosts=True, timeout=5), request=_request()))
        [pending] = await _pending(two)
        assert pending.id != ended.id
        await two.answer(pending.id, "deny", by="x")
        assert (await again).state == "denied"  # type: ignore[union-attr]

    _run(scenario, tmp_path / "state.db")


def test_an_answer_for_nothing_is_not_found(tmp_path: Path) -> None:
    async def scenario(services: list[ApprovalService], lines: list[Any]) -> None:
        with pytest.raises(NotFound):
            await services[0].answer("ap_nothing", "approve", by="a")

    _run(scenario, tmp_path / "state.db")


def test_a_sandbox_has_a_bounded_number_of_asks_waiting(tmp_path: Path) -> None:
    """One sandbox cannot flood the people answering (or the store): past MAX_PENDING
    asks waiting, a new one is not asked; the same thing asked again still joins, and
    another sandbox is asked as ever."""
    from gateway.core.approvals import MAX_PENDING, AskLimit

    async def scenario(services: list[ApprovalService], lines: list[Any]) -> None:
        one, two = services
        spec = Ask(hosts=True, timeout=10)
        held = [asyncio.create_task(one.ask(_identity(), asked, "no rule", spec,
                                            request=_request(asked)))
                for asked in [Asked("host", f"h{n}.test", 443) for n in range(MAX_PENDING)]]
        await _pending(one, MAX_PENDING)
        with pytest.raises(AskLimit, match=f"already has {MAX_PENDING} asks waiting"):
            more = Asked("host", "more.test", 443)
            await two.ask(_identity(), more, "no rule", spec, request=_request(more))
        h0 = Asked("host", "h0.test", 443)
        joined = asyncio.create_task(two.ask(_identity(), h0, "no rule", spec,
                                             request=_request(h0)))
        other = asyncio.create_task(two.ask(_identity("s2"), ASKED, "no rule", spec,
                                            request=_request()))
        await _pending(one, MAX_PENDING + 1)
        for approval in await one.approvals():
            await one.answer(approval.id, "deny", by="x")
        assert {a.state for a in await asyncio.gather(*held, joined, other)} == {"denied"}

    _run(scenario, tmp_path / "state.db")


def test_a_grant_written_anywhere_releases_every_held_request_it_covers(
        tmp_path: Path) -> None:
    """A policy grant answered on one process for one sandbox's ask lets another
    sandbox's request held on the other process go within a tenth of a second (the
    watcher: pushed by the store's change counter, not the held request's own poll), and
    closes that sandbox's approval as approved by the grant; a process that has not
    loaded a grant yet re-reads the grants before it asks, so it does not ask again."""
    async def scenario(services: list[ApprovalService], lines: list[Any]) -> None:
        one, two = services
        for service in services:
            await service.start()
        spec = Ask(hosts=True, timeout=10)
        first = asyncio.create_task(two.ask(_identity("s1"), ASKED, "no rule", spec,
                                            request=_request()))
        held = asyncio.create_task(one.ask(_identity("s2"), ASKED, "no rule", spec,
                                           request=_request()))
        pending = await _pending(two, 2)
        await asyncio.sleep(0.3)  # (both held past a poll of their own approvals)
        mine = next(a for a in pending if a.sandbox == "s1")
        _, grant, _ = await two.answer(mine.id, "approve", scope="policy", duration="1h",
                                       by="alice")
        answered = time.monotonic()
        released = await held
        took = time.monotonic() - answered
        assert isinstance(released, Grant) and released == grant
        assert took < 0.15, took  # (WATCH is 0.05 s; the approval's own poll is 0.2 s)
        assert isinstance(await first, Approval)
        closed = next(a for a in await one.approvals() if a.sandbox == "s2")
        assert (closed.state, closed.grant, closed.by) == ("approved", grant.id, "alice")
        assert closed.note == f"covered by grant {grant.id}"
        # Another process's view, not refreshed since: the ask re-reads the grants first.
        for service in services:
            await service.watcher.stop()
        three = ApprovalService(two.store, audit=lines.append)
        assert three.grant_for("s3", "agent", _request()) is None
        got = await three.ask(_identity("s3"), ASKED, "no rule", spec, request=_request())
        assert got == grant
        assert not [a for a in await three.approvals() if a.sandbox == "s3"]
        # A grant for one path does not close an ask for the whole host.
        assert not Asked("request", "new.test", 443, "GET", "/x").includes(ASKED)
        assert ASKED.includes(Asked("request", "new.test", 443, "GET", "/x"))

    lines = _run(scenario, tmp_path / "state.db")
    assert [line["decision"] for line in lines] == ["ask", "ask", "approve", "approve"]
    assert "covered by grant" in lines[-1]["reason"]


CONSENT = Asked("oauth", "mcp.test", 443, path="/mcp")


def test_one_consent_per_grant_across_sandboxes_and_processes(tmp_path: Path) -> None:
    """Two sandboxes, on two processes, asking the consent of one grant (same key and
    scopes) share one approval; other scopes are another approval; past its expiry the
    consent is timed out once (one audit line), whichever process settles it."""
    async def scenario(services: list[ApprovalService], lines: list[Any]) -> None:
        one, two = services
        spec = Ask(timeout=0.5, timed=True)
        first, opened = await one.open_consent(_identity("s1"), CONSENT, "consent", spec,
                                               {"url": "https://a.test/1"}, "g|mcp")
        joined, again = await two.open_consent(_identity("s2"), CONSENT, "consent", spec,
                                               {"url": "https://a.test/2"}, "g|mcp")
        other, third = await two.open_consent(_identity("s2"), CONSENT, "consent", spec,
                                              {"url": "https://a.test/3"}, "g|mcp more")
        assert (opened, again, third) == (True, False, True)
        assert joined.id == first.id and joined.consent == {"url": "https://a.test/1"}
        assert other.id != first.id
        assert (await one.settled(first.id)).state == "pending"
        await asyncio.sleep(0.6)
        ended = await asyncio.gather(one.settled(first.id), two.settled(first.id))
        assert [e.state for e in ended] == ["timeout", "timeout"]
        with pytest.raises(NotFound):
            await one.settled("ap_none")

    lines = _run(scenario, tmp_path / "state.db")
    assert [line["decision"] for line in lines].count("timeout") == 1
    assert [line["decision"] for line in lines].count("ask") == 2
