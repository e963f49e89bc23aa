"""The audit spill journal (gateway/observability/audit_spill.py) with the audit sink, on
real files (issue 46, item 5).

Before: lines held in memory while the output failed were dropped at the stop (4,413 in
one run), and lines past `audit.buffer` were dropped while it ran. Now they go to the
journal, which the next start (or the output taking lines again) writes first, in order,
none twice; only what exceeds the buffer and the journal is dropped, counted and named
in the log with its time range.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.disk import tiny_tmpfs

from gateway.observability.audit import Auditor
from gateway.observability.audit_out import open_file
from gateway.observability.audit_spill import SEGMENT, Spill, adopt

BUFFER = 64 * 1024


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (a disk that fills up), unmounted afterwards."""
    yield from tiny_tmpfs(tmp_path / "disk", "64k")


def record(seq: int, pad: int = 200) -> dict[str, Any]:
    return {"sandbox": "s", "policy": "p", "decision": "allow", "path_taken": "intercept",
            "seq": seq, "pad": "x" * pad}


def seqs_of(path: Path) -> list[int]:
    text = path.read_bytes()
    assert not text or text.endswith(b"\n"), f"a cut line at the end: {text[-80:]!r}"
    return [json.loads(line)["seq"] for line in text.splitlines()]


def failing_sink(spill: Spill, **options: Any) -> Auditor:
    """A sink whose output fails every write (/dev/full: ENOSPC), with `spill`."""
    return Auditor(open_file(Path("/dev/full")), buffer=BUFFER, spill=spill, retry=0.05,
                   **options)


def produce(sink: Auditor, seqs: range, pad: int = 200) -> list[dict[str, Any]]:
    """Write a record per seq, a few per loop tick; the records (with their times)."""
    records = [record(i, pad) for i in seqs]

    async def run() -> None:
        for i, rec in enumerate(records):
            sink.write(rec)
            if i % 5 == 0:
                await asyncio.sleep(0)
        await asyncio.sleep(0.1)  # (retried, failing, meanwhile)
        await sink.aclose(wait=0.1)

    asyncio.run(run())
    return records


def restart(spill_dir: Path, audit: Path, limit: int) -> Auditor:
    """The next start: a sink on a real file that takes lines, the journal written first."""
    sink = Auditor(open_file(audit), spill=Spill(spill_dir, limit))
    sink.start()
    return sink


def test_lines_held_and_spilled_are_written_first_at_the_next_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spill_dir = tmp_path / "spill"
    sink = failing_sink(Spill(spill_dir, 8 << 20))
    with caplog.at_level("INFO", "sandbox_gateway"):
        produce(sink, range(2000))  # ~500 KB: the buffer's 64 KiB, the rest spilled
    assert sink.dropped == 0
    [kept] = [r.message for r in caplog.records if "kept in the spill journal" in r.message]
    assert re.match(r"\d+ audit line\(s\) could not be written to /dev/full before the "
                    r"gateway stopped \(No space left on device \(ENOSPC\)", kept), kept
    assert "written first at the next start" in kept
    assert not any("they are lost" in r.message for r in caplog.records)
    segments = sorted(spill_dir.iterdir())
    assert segments and all(p.stat().st_mode & 0o777 == 0o600 for p in segments)

    audit = tmp_path / "audit.jsonl"
    audit.write_bytes(b'{"seq":-1}\n')  # the file as the outage left it
    caplog.clear()
    with caplog.at_level("INFO", "sandbox_gateway"):
        sink = restart(spill_dir, audit, 8 << 20)

        async def run() -> None:
            for i in range(2000, 2010):  # new lines come after the kept ones
                sink.write(record(i))
                await asyncio.sleep(0)
            await sink.aclose()

        asyncio.run(run())
    assert seqs_of(audit) == [-1, *range(2010)]  # all, in order, none twice
    assert list(spill_dir.iterdir()) == []  # the journal is written out
    assert any("are written to" in r.message and "first" in r.message
               for r in caplog.records)


def test_a_full_journal_drops_the_excess_counts_and_names_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The journal's bound (with the buffer's lines it takes at the stop): the lines past
    it are the ones dropped, counted, and named in the log with their time range."""
    spill_dir = tmp_path / "spill"
    limit = 2 * BUFFER
    sink = failing_sink(Spill(spill_dir, limit))
    with caplog.at_level("INFO", "sandbox_gateway"):
        records = produce(sink, range(2000))
    size = sum(p.stat().st_size for p in spill_dir.iterdir())
    assert limit - 1024 < size <= limit  # full, never past its bound
    assert 0 < sink.dropped < 2000

    audit = tmp_path / "audit.jsonl"
    restart(spill_dir, audit, limit).close()
    kept = seqs_of(audit)
    assert kept == list(range(len(kept)))  # the oldest lines, in order
    assert len(kept) + sink.dropped == 2000  # the rest dropped, and counted
    dropped = records[len(kept):]
    begun = [r.message for r in caplog.records if "are being dropped" in r.message]
    ended = [r.message for r in caplog.records if "were dropped" in r.message]
    assert len(begun) == 1 and dropped[0]["time"] in begun[0]
    assert len(ended) == 1, ended
    assert ended[0].startswith(f"{sink.dropped} audit line(s) were dropped, those of "
                               f"{dropped[0]['time']} to {dropped[-1]['time']}")
    assert "audit.spill.max: 131072 bytes" in ended[0]


def test_without_a_journal_the_lines_past_the_buffer_are_dropped_and_named(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sink = Auditor(open_file(Path("/dev/full")), buffer=BUFFER, retry=0.05)
    with caplog.at_level("INFO", "sandbox_gateway"):
        produce(sink, range(1000))
    assert sink.dropped == 1000  # past the buffer while running, the buffer at the stop
    ended = [r.message for r in caplog.records if "were dropped" in r.message]
    assert len(ended) == 1 and ended[0].startswith("1000 audit line(s) were dropped")
    assert "no spill journal (audit.spill.max: 0)" in ended[0]


def test_the_journal_is_written_out_while_running_when_the_output_recovers(
        tmp_path: Path) -> None:
    """No restart: the output takes lines again, and gets the held lines, the journal's,
    then the new ones; segments are deleted as they are written."""
    disk = tmp_path / "audit.jsonl"
    out = open_file(disk)
    failing = {"on": True}
    real_write = out.write

    def write(data: bytes) -> int:
        if failing["on"]:
            raise OSError(28, "No space left on device")
        return real_write(data)

    out.write = write  # type: ignore[method-assign]
    spill_dir = tmp_path / "spill"
    sink = Auditor(out, buffer=BUFFER, spill=Spill(spill_dir, 64 << 20), retry=0.02)

    async def run() -> None:
        for i in range(12000):  # ~3 MB: more than a segment
            sink.write(record(i))
            if i % 50 == 0:
                await asyncio.sleep(0)
        assert sink.problem is not None and len(list(spill_dir.iterdir())) > 1
        failing["on"] = False
        for i in range(12000, 12100):  # while the journal is written out
            sink.write(record(i))
            await asyncio.sleep(0.001)
        for _ in range(200):
            if sink.spill is not None and not sink.spill.pending:
                break
            await asyncio.sleep(0.01)
        await sink.aclose()

    asyncio.run(run())
    assert sink.problem is None and sink.dropped == 0
    assert seqs_of(disk) == list(range(12100))
    assert list(spill_dir.iterdir()) == []


def test_a_half_written_segment_keeps_only_its_unwritten_rest(tmp_path: Path) -> None:
    spill = Spill(tmp_path, 64 << 20)
    spill.append(b"".join(b'{"seq":%d}\n' % i for i in range(100)))
    taken = spill.peek(300)
    assert taken.endswith(b"\n") and len(taken) <= 300
    spill.consume(len(taken))
    spill.close()
    again = Spill(tmp_path, 64 << 20)
    rest = b""
    while data := again.peek(1 << 20):
        rest += data
        again.consume(len(data))
    written = [json.loads(line)["seq"] for line in taken.splitlines()]
    assert [json.loads(line)["seq"] for line in rest.splitlines()] == \
        list(range(len(written), 100))
    again.close()
    assert list(tmp_path.iterdir()) == []


def test_a_line_cut_by_a_crash_is_dropped_at_the_next_start(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    spill = Spill(tmp_path, 64 << 20)
    spill.append(b'{"seq":1}\n{"seq":2}\n')
    spill.close()
    [segment] = tmp_path.iterdir()
    with segment.open("ab") as f:
        f.write(b'{"seq":3')  # the crash
    with caplog.at_level("ERROR", "sandbox_gateway"):
        again = Spill(tmp_path, 64 << 20)
    assert again.bytes == len(b'{"seq":1}\n{"seq":2}\n')
    assert again.peek(1 << 20) == b'{"seq":1}\n{"seq":2}\n'
    assert any("cut short" in r.message for r in caplog.records)
    again.close()


def test_segments_roll_over_and_the_stop_prepends_older_lines(tmp_path: Path) -> None:
    spill = Spill(tmp_path, 64 << 20, owner=2)
    line = b"y" * 1023 + b"\n"
    for _ in range(SEGMENT // len(line) * 2 + 1):
        spill.append(line)
    spill.prepend(b"older\n")
    spill.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 4 and all(re.fullmatch(r"2-\d{20}-\d{9}\.jsonl", n) for n in names)
    assert names[0].endswith("-000000000.jsonl")
    again = Spill(tmp_path, 64 << 20, owner=2)
    assert again.peek(6) == b"older\n"
    assert Spill(tmp_path, 64 << 20, owner=1).pending is False  # another worker's
    again.close()


def test_a_supervisor_gives_the_segments_of_workers_it_no_longer_runs_to_worker_0(
        tmp_path: Path) -> None:
    for owner in (0, 1, 2, 3):
        spill = Spill(tmp_path, 64 << 20, owner=owner)
        spill.append(b'{"owner":%d}\n' % owner)
        spill.close()
    assert adopt(tmp_path, 2) == 2
    worker0 = Spill(tmp_path, 64 << 20, owner=0)
    lines = b""
    while data := worker0.peek(1 << 20):
        lines += data
        worker0.consume(len(data))
    worker0.close()
    assert sorted(json.loads(x)["owner"] for x in lines.splitlines()) == [0, 2, 3]
    assert Spill(tmp_path, 64 << 20, owner=1).pending
    single = Spill(tmp_path, 64 << 20, adopt_all=True)  # a single process: every one
    assert single.pending and single.bytes == len(b'{"owner":1}\n')
    single.close()


def test_an_unwritable_journal_directory_is_an_error_at_once(tmp_path: Path) -> None:
    if os.geteuid() == 0:  # (root writes anywhere: a file in the way instead)
        (tmp_path / "file").write_text("")
        with pytest.raises(OSError):
            Spill(tmp_path / "file" / "spill", 64 << 20)
        return
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(OSError):
            Spill(tmp_path / "spill", 64 << 20)
    finally:
        tmp_path.chmod(0o700)


def test_a_journal_on_a_full_disk_keeps_whole_lines_and_names_what_it_drops(
        tmp_path: Path, tmpfs: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The journal's own disk fills: an append cut short is cut back to whole lines, the
    lines it cannot take are dropped, counted and logged with the reason."""
    spill_dir = tmpfs / "spill"
    sink = failing_sink(Spill(spill_dir, 8 << 20))
    with caplog.at_level("INFO", "sandbox_gateway"):
        produce(sink, range(1000))
    assert sink.dropped > 0
    assert any("cannot be written: No space left on device" in r.message
               for r in caplog.records)
    ended = [r.message for r in caplog.records if "were dropped" in r.message]
    assert len(ended) == 1 and ended[0].startswith(f"{sink.dropped} audit line(s)")
    audit = tmp_path / "audit.jsonl"
    restart(spill_dir, audit, 8 << 20).close()
    kept = seqs_of(audit)  # whole lines only
    assert kept and kept == list(range(kept[0], kept[0] + len(kept)))  # in order
    assert len(kept) + sink.dropped == 1000
