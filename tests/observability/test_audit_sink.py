"""The audit sink (gateway/observability/audit.py, audit_out.py) against real targets: a
file, a tmpfs that fills up, a pipe whose reader stops, a broken pipe, /dev/full (issue 21, item 9).

Lines are written once per loop tick; a line that cannot be written is held, in order,
and written when the target takes lines again; the sink says why it cannot write
(`problem`, and `refusing` with `on_failure: refuse`); the file never holds a cut line;
stopping is never held up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.disk import tiny_tmpfs

from gateway.observability.audit import Auditor, encode
from gateway.observability.audit_out import FdOut, open_file, open_stdout

_JSON = json.JSONEncoder(separators=(",", ":"), default=str).encode

# (record, same bytes as the json module's): what `encode` is given, and whether its
# line must be byte for byte the json module's line.
ENCODED = [
    ({"sandbox": "s", "port": 443, "duration_ms": 1.234, "error": None, "ok": True,
      "usage": {"input_tokens": 12, "cost": 0.5}, "mcp": [{"tool": "t", "args": ["a"]}]},
     True),
    ({"path": "/p\"q\\r/s\n\t\x01\x1f", "reason": "x" * 600}, True),
    ({"path": "/caf\u00e9", "host": "\u2028"}, True),  # (not ASCII: the json module)
    ({"path": "/del\x7f"}, True),  # (DEL: escaped by the json module alone)
    ({"big": 2 ** 70, "neg": -0.0, "third": 1 / 3, "ints": {1: "a"}}, True),
    ({"odd": object.__new__(type("Odd", (), {"__str__": lambda self: "odd"}))}, True),
    ({"tiny": 1e-05, "huge": 1e16}, False),  # (exponent form: the same numbers)
]


@pytest.mark.parametrize(("value", "same"), ENCODED)
def test_a_line_is_json_of_the_record(value: dict[str, Any], same: bool) -> None:
    line = encode(value)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert line.isascii()
    assert json.loads(line) == json.loads(_JSON(value))
    assert (line == (_JSON(value) + "\n").encode()) is same


def record(seq: int, pad: int = 200) -> dict[str, Any]:
    return {"sandbox": "s", "policy": "p", "decision": "allow", "path_taken": "intercept",
            "seq": seq, "pad": "x" * pad}


class Counted(FdOut):
    """A real file target that also counts its writes and short writes."""

    def __init__(self, out: FdOut) -> None:
        self.__dict__.update(out.__dict__)
        self.writes = 0
        self.short = 0

    def write(self, data: bytes) -> int:
        self.writes += 1
        try:
            taken = os.write(self._fd, data)
        except BlockingIOError:
            return 0
        if taken < len(data):
            self.short += 1
            return self._cut_partial(data, taken)
        return taken


def lines_of(path: Path) -> list[dict[str, Any]]:
    text = path.read_bytes()
    assert not text or text.endswith(b"\n"), f"a cut line at the end: {text[-80:]!r}"
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (a disk that fills up), unmounted afterwards."""
    yield from tiny_tmpfs(tmp_path / "disk", "64k")


async def ticks(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_the_lines_of_one_tick_are_one_write(tmp_path: Path) -> None:
    out = Counted(open_file(tmp_path / "audit.jsonl"))
    sink = Auditor(out)

    async def run() -> None:
        for i in range(50):  # one callback's worth of exchanges ending
            sink.write(record(i))
        assert out.writes == 0  # not yet: at the end of the tick
        await ticks()
        assert out.writes == 1
        for i in range(50, 53):  # one line per tick: one write each
            sink.write(record(i))
            await ticks()

    asyncio.run(run())
    assert out.writes == 4
    assert [r["seq"] for r in lines_of(tmp_path / "audit.jsonl")] == list(range(53))
    sink.close()
    sink.write(record(53))  # a connection cut off by the stop: counted, never written
    assert sink.dropped == 1 and out.writes == 4 and len(lines_of(tmp_path / "audit.jsonl")) == 53


def test_a_full_disk_holds_the_lines_refuses_and_resumes_in_order(tmpfs: Path) -> None:
    """The disk fills: writes fail (ENOSPC), lines are held, the sink refuses; a batch
    that only partly fitted is cut back to whole lines; space returns: the held lines
    are written in order, complete, and the sink is available again by itself."""
    filler = tmpfs / "filler"
    filler.write_bytes(b"f" * 16 * 1024)
    out = Counted(open_file(tmpfs / "audit.jsonl"))
    sink = Auditor(out, retry=0.05)

    async def run() -> tuple[int, int]:
        seq = 0
        while sink.problem is None:
            assert seq < 2000, "the disk never filled"
            for _ in range(7):  # several lines per tick: a batch crosses the end
                sink.write(record(seq))
                seq += 1
            await ticks()
        failed_at = seq
        assert "No space left on device (ENOSPC)" in sink.problem
        assert sink.refusing == sink.problem  # on_failure: refuse
        lines_of(tmpfs / "audit.jsonl")  # whole lines only, while the disk is full
        for _ in range(20):  # exchanges under way still end: held
            sink.write(record(seq))
            seq += 1
        await asyncio.sleep(0.2)  # retried (and failing) meanwhile
        assert sink.problem is not None and sink.held_bytes > 0
        filler.unlink()
        deadline = time.monotonic() + 3
        while sink.problem is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return failed_at, seq

    failed_at, total = asyncio.run(run())
    assert sink.problem is None and sink.refusing is None and sink.held_bytes == 0
    assert out.short >= 1, "no batch was cut by the full disk (the test did not test that)"
    assert [r["seq"] for r in lines_of(tmpfs / "audit.jsonl")] == list(range(total))
    assert sink.dropped == 0 and failed_at < total
    sink.close()


@pytest.mark.parametrize(("on_failure", "refuses"), [("refuse", True), ("continue", False)])
def test_on_failure_decides_whether_exchanges_are_refused(on_failure: str,
                                                          refuses: bool) -> None:
    """/dev/full fails every write (ENOSPC). `refuse`: `refusing` says why; `continue`:
    the gateway serves on; either way lines past the buffer are dropped and counted."""
    sink = Auditor(open_file(Path("/dev/full")), on_failure=on_failure, buffer=64 * 1024)

    async def run() -> None:
        for i in range(400):  # ~100 KB: more than the buffer
            sink.write(record(i))
            await ticks(1)

    asyncio.run(run())
    assert sink.problem is not None and "ENOSPC" in sink.problem
    assert (sink.refusing is not None) is refuses
    assert sink.dropped > 0 and sink.held_bytes <= 64 * 1024
    started = time.monotonic()
    asyncio.run(sink.aclose())
    assert time.monotonic() - started < 0.5  # a failing target is tried once at stop


def test_a_pipe_whose_reader_stops(caplog: pytest.LogCaptureFixture) -> None:
    """stdout as a pipe: the sink never blocks the loop. Lines wait in the pipe, then in
    the buffer; past 7/8 of it the sink refuses (one log line), past all of it lines are
    dropped and counted; when the reader reads again everything held arrives, in order,
    whole, and the sink is available again by itself."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, True)
    out = open_stdout(write_end)
    assert os.get_blocking(write_end), "stdout's own description was made non-blocking"
    sink = Auditor(out, buffer=64 * 1024)
    received = bytearray()

    async def run() -> int:
        seq = 0
        while sink.dropped == 0:
            assert seq < 5000, "the pipe never filled"
            sink.write(record(seq))
            seq += 1
            await ticks(1)  # the loop runs on: a blocking write would hang the test here
        assert sink.refusing is not None and "stdout has not taken audit lines" \
            in sink.refusing
        reader = threading.Thread(target=lambda: _drain(read_end, received, sink))
        reader.start()
        deadline = time.monotonic() + 5
        while sink.held_bytes and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert sink.problem is None and sink.refusing is None
        for i in range(seq, seq + 10):  # and on it goes
            sink.write(record(i))
            await ticks(1)
        await asyncio.sleep(0.1)
        return seq + 10

    try:
        with caplog.at_level("INFO", "sandbox_gateway"):
            total = asyncio.run(run())
        sink.close()
        time.sleep(0.2)
    finally:
        os.close(write_end)
    lines = [json.loads(line) for line in bytes(received).splitlines()]
    seqs = [r["seq"] for r in lines]
    kept = total - sink.dropped
    assert len(seqs) == kept and seqs == sorted(seqs)  # in order, whole
    assert seqs[-10:] == list(range(total - 10, total))
    outages = [r.message for r in caplog.records if "cannot be written" in r.message]
    assert len(outages) == 1 and not any(r.exc_info for r in caplog.records)
    assert any("written again" in r.message for r in caplog.records)


def _drain(fd: int, into: bytearray, sink: Auditor) -> None:
    with contextlib.suppress(OSError):
        while chunk := os.read(fd, 65536):
            into += chunk
    os.close(fd)


def test_a_broken_pipe_is_a_problem_not_a_traceback() -> None:
    read_end, write_end = os.pipe()
    sink = Auditor(open_stdout(write_end), retry=0.05)
    os.close(read_end)
    os.close(write_end)

    async def run() -> None:
        sink.write(record(1))
        await ticks()

    asyncio.run(run())
    assert sink.problem is not None and "EPIPE" in sink.problem
    sink.close()


def test_stop_waits_briefly_for_a_blocked_pipe_then_reports_the_loss(
        caplog: pytest.LogCaptureFixture) -> None:
    read_end, write_end = os.pipe()
    sink = Auditor(open_stdout(write_end), buffer=256 * 1024)

    async def run() -> float:
        for i in range(600):  # ~150 KB: more than the pipe takes
            sink.write(record(i))
            await ticks(1)
        assert sink.held_bytes > 0
        started = time.monotonic()
        await sink.aclose(wait=0.3)
        return time.monotonic() - started

    try:
        with caplog.at_level("ERROR", "sandbox_gateway"):
            took = asyncio.run(run())
    finally:
        os.close(read_end)
        os.close(write_end)
    assert 0.25 < took < 1.0
    [lost] = [r.message for r in caplog.records if "could not be written" in r.message]
    assert "they are lost" in lost and sink.dropped > 0
