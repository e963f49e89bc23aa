"""The audit trail loses nothing (issue 21, item 9), on a real `sandbox-gateway run`.

Measured on the code before: with the audit file's disk full the gateway served on
without auditing, cut a third of the keep-alive requests with a traceback each, kept
/readyz at 200, moved no metric and failed its stop; with stdout as a pipe whose reader
stopped it blocked altogether (admin API included). Now new exchanges are refused `503
audit_unavailable` (never cut), /readyz and a metric and one log line say why, held
lines are written in order when the target takes them again, and the stop is not held
up.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.disk import tiny_tmpfs
from helpers.nginx import Nginx
from helpers.process import GatewayProcess, start_gateway
from helpers.tls import LocalCA


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs for the audit file (a disk that fills up), unmounted afterwards."""
    yield from tiny_tmpfs(tmp_path / "disk", "256k")


class Stderr:
    """The gateway's stderr, read as it comes (so a full pipe never stalls it)."""

    def __init__(self, gw: GatewayProcess) -> None:
        assert gw.proc.stderr is not None
        self.text = ""
        self._stream = gw.proc.stderr
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self._stream:
            self.text += line

    def all(self, timeout: float = 15) -> str:
        self._thread.join(timeout)
        return self.text


class Session:
    """One keep-alive TLS connection through the gateway to inspect.test."""

    def __init__(self, gw: GatewayProcess, token: str) -> None:
        sock = socket.create_connection(("127.0.0.1", gw.proxy), timeout=10)
        cred = base64.b64encode(f"sbx-1:{token}".encode()).decode()
        sock.sendall(f"CONNECT inspect.test:443 HTTP/1.1\r\nProxy-Authorization: Basic "
                     f"{cred}\r\n\r\n".encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        ctx = ssl.create_default_context(cafile=str(gw.workdir / "certs" / "ca.crt"))
        self.tls = ctx.wrap_socket(sock, server_hostname="inspect.test")

    def get(self) -> int:
        """One GET /small; its status. Fails the test if the connection is cut."""
        self.tls.sendall(b"GET /small HTTP/1.1\r\nHost: inspect.test\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.tls.recv(65536)
            assert chunk, f"the connection was cut (got {data[:80]!r})"
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
        while len(body) < length:
            chunk = self.tls.recv(65536)
            assert chunk, "the connection was cut mid-body"
            body += chunk
        status = int(head.split(b" ", 2)[1])
        if status == 503:
            assert b"audit_unavailable" in head, head
        return status

    def close(self) -> None:
        self.tls.close()


def readyz(gw: GatewayProcess) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{gw.admin}/readyz", timeout=5) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metric(gw: GatewayProcess, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{gw.admin}/metrics", timeout=5).read()
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def fill(disk: Path, name: str) -> None:
    """Fill the tmpfs up with a file."""
    with contextlib.suppress(OSError), (disk / name).open("wb", buffering=0) as f:
        while True:
            f.write(b"f" * 4096)


def test_a_full_audit_disk_refuses_then_recovers_by_itself(
        tmpfs: Path, tmp_path: Path, nginx: Nginx, test_ca: LocalCA) -> None:
    (tmpfs / "filler").write_bytes(b"f" * 160 * 1024)
    audit = tmpfs / "audit.jsonl"
    gw = start_gateway(tmp_path / "gw", {"inspect.test": nginx.port}, test_ca,
                       extra={"audit": {"path": str(audit)}})
    err = Stderr(gw)
    try:
        session = Session(gw, gw.token())
        statuses: list[int] = []
        while statuses[-3:] != [503, 503, 503]:
            assert len(statuses) < 3000, "the audit disk never filled"
            statuses.append(session.get())
        assert set(statuses) == {200, 503}
        code, body = readyz(gw)
        assert code == 503 and "audit lines cannot be written" in body, body
        assert "No space left on device" in body and "audit_unavailable" in body
        assert metric(gw, "sandbox_gateway_audit_up") == 0
        assert metric(gw, "sandbox_gateway_audit_write_errors_total") >= 1
        (tmpfs / "filler").unlink()  # space returns: the gateway resumes by itself
        deadline = time.monotonic() + 5
        while statuses[-1] != 200:
            assert time.monotonic() < deadline, "writing did not resume"
            time.sleep(0.1)
            statuses.append(session.get())
        for _ in range(5):
            statuses.append(session.get())
        assert statuses[-6:] == [200] * 6
        assert readyz(gw)[0] == 200 and metric(gw, "sandbox_gateway_audit_up") == 1
        session.close()
        time.sleep(0.3)
        text = audit.read_bytes()
        assert text.endswith(b"\n")
        lines = [json.loads(line) for line in text.splitlines()]  # whole lines only
        small = [r for r in lines if r["path"] == "/small"]
        # Every answered request is on the trail, in order: the refusals (held while the
        # disk was full) included.
        assert [r["status"] for r in small] == statuses
        assert [r["time"] for r in small] == sorted(r["time"] for r in small)

        # Full again, and stopped: the stop is not held up, the held lines are kept in the
        # spill journal (test_lines_held_at_a_stop_are_written_first_at_the_next_start).
        fill(tmpfs, "filler2")
        session = Session(gw, gw.token())
        while session.get() != 503:
            pass
        started = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(15) == 0
        assert time.monotonic() - started < 5  # shutdown.drain is 10s
        session.close()
    finally:
        gw.stop()
    log = err.all()
    assert "Traceback" not in log, log[-3000:]
    assert log.count("audit lines cannot be written") == 2, log
    assert log.count("audit lines are written again") == 1, log
    assert "could not be written to" in log and "they are kept in the spill journal" in log
    assert "they are lost" not in log and "were dropped" not in log


def test_lines_held_at_a_stop_are_written_first_at_the_next_start(
        tmpfs: Path, tmp_path: Path, nginx: Nginx, test_ca: LocalCA) -> None:
    """Issue 46, item 5. The audit disk fills, requests go on (refused 503, each audited:
    the lines fill audit.buffer and go on into the spill journal), SIGTERM, space is
    freed, the gateway starts again: every line is in the audit file, in order, none
    twice, the journal's before the new ones. Before: the lines held at the stop were
    dropped (4,413 in one run), and those past audit.buffer while it ran."""
    (tmpfs / "filler").write_bytes(b"f" * 200 * 1024)
    audit = tmpfs / "audit.jsonl"
    config = {"audit": {"path": str(audit), "buffer": "64k"}}
    gw = start_gateway(tmp_path / "gw", {"inspect.test": nginx.port}, test_ca, extra=config)
    err = Stderr(gw)
    statuses: list[int] = []
    try:
        session = Session(gw, gw.token())
        try:
            while statuses[-1:] != [503]:
                assert len(statuses) < 3000, "the audit disk never filled"
                statuses.append(session.get())
            while sum(s == 503 for s in statuses) < 250:  # ~150 KB of lines: past the buffer
                statuses.append(session.get())
            # (the buffer is full: lines go on into the journal)
            assert metric(gw, "sandbox_gateway_audit_spilled_bytes") > 0
            gw.proc.send_signal(signal.SIGTERM)
            assert gw.proc.wait(15) == 0
        finally:
            session.close()
    finally:
        gw.stop()
    first_log = err.all()
    assert "they are kept in the spill journal" in first_log, first_log[-2000:]
    assert "they are lost" not in first_log and "dropped" not in first_log.replace(
        "0 dropped", ""), first_log[-2000:]
    journal = tmp_path / "gw" / "state" / "audit-spill"
    assert sum(p.stat().st_size for p in journal.iterdir()) > 100 * 1024
    on_disk = audit.read_bytes().count(b"\n")
    assert on_disk < len(statuses)

    (tmpfs / "filler").unlink()  # space returns; the gateway starts again
    gw = start_gateway(tmp_path / "gw", {"inspect.test": nginx.port}, test_ca, extra=config)
    err = Stderr(gw)
    try:
        assert readyz(gw)[0] == 200
        session = Session(gw, gw.token())
        try:
            after = [session.get() for _ in range(5)]
        finally:
            session.close()
        assert after == [200] * 5
        assert metric(gw, "sandbox_gateway_audit_spilled_bytes") == 0
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(15) == 0
    finally:
        gw.stop()
    second_log = err.all()
    assert "kept in the spill journal" in second_log and "written to" in second_log
    assert list(journal.iterdir()) == []
    lines = [json.loads(line) for line in audit.read_bytes().splitlines()]
    small = [r for r in lines if r.get("path") == "/small"]
    assert [r["status"] for r in small] == statuses + after  # all, in order, none twice
    assert [r["time"] for r in small] == sorted(r["time"] for r in small)
    assert "Traceback" not in first_log + second_log


def test_a_stdout_pipe_whose_reader_stops(tmp_path: Path, nginx: Nginx,
                                          test_ca: LocalCA) -> None:
    """Audit lines on stdout, a pipe nobody reads: the gateway keeps its event loop (the
    admin API answers), holds lines up to audit.buffer and then refuses; once the pipe
    is read again every held line arrives, whole and in order, and it serves again."""
    gw = start_gateway(tmp_path / "gw", {"inspect.test": nginx.port}, test_ca,
                       extra={"audit": {"path": None, "buffer": "64k"}},
                       stdout=subprocess.PIPE)
    err = Stderr(gw)
    assert gw.proc.stdout is not None
    out_fd = gw.proc.stdout.fileno()
    received = bytearray()
    try:
        session = Session(gw, gw.token())
        statuses: list[int] = []
        while statuses[-3:] != [503, 503, 503]:
            assert len(statuses) < 3000, "the pipe never filled"
            statuses.append(session.get())
        started = time.monotonic()
        code, body = readyz(gw)
        assert time.monotonic() - started < 2  # the event loop is not blocked
        assert code == 503 and "stdout has not taken audit lines" in body, body
        reader = threading.Thread(target=lambda: _read_all(out_fd, received), daemon=True)
        reader.start()
        deadline = time.monotonic() + 5
        while statuses[-1] != 200:
            assert time.monotonic() < deadline, "writing did not resume"
            time.sleep(0.1)
            statuses.append(session.get())
        assert readyz(gw)[0] == 200
        session.close()
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(15) == 0
        reader.join(5)
    finally:
        gw.stop()
        gw.proc.stdout.close()
    assert received.endswith(b"\n")
    lines = [json.loads(line) for line in bytes(received).splitlines()]
    small = [r["status"] for r in lines if r.get("path") == "/small"]
    assert small == statuses  # nothing lost (the buffer held it all), in order
    assert "Traceback" not in err.all()


def _read_all(fd: int, into: bytearray) -> None:
    with contextlib.suppress(OSError):
        while chunk := os.read(fd, 65536):
            into += chunk


def test_an_audit_file_that_cannot_be_opened_stops_the_start(
        tmp_path: Path, nginx: Nginx, test_ca: LocalCA) -> None:
    (tmp_path / "a-directory").mkdir()
    gw = start_gateway(tmp_path / "gw", {"inspect.test": nginx.port}, test_ca,
                       extra={"audit": {"path": str(tmp_path / "a-directory")}}, wait=False)
    try:
        assert gw.proc.wait(30) == 2
        err = gw.stderr()
        assert "audit.path: cannot open" in err and "Traceback" not in err, err
    finally:
        gw.stop()


def test_worker_processes_spill_their_own_lines_and_one_process_takes_them_all(
        tmpfs: Path, tmp_path: Path, nginx: Nginx, test_ca: LocalCA) -> None:
    """`run --workers 2`: each worker spills its own lines (its own journal files); the
    next start, a single process, writes both workers' lines first. Every connection's
    lines are in the file in its order, none twice."""
    audit = tmpfs / "audit.jsonl"
    config = {"audit": {"path": str(audit), "buffer": "64k"}}
    gw = start_gateway(tmp_path / "gw", {"inspect.test": nginx.port}, test_ca, workers=2,
                       extra=config)
    err = Stderr(gw)
    sessions: list[Session] = []
    statuses: dict[str, list[int]] = {}  # by the connection's client address
    try:
        token = gw.token()
        workers: set[int] = set()
        while workers != {0, 1}:  # connections on both workers (the kernel spreads them)
            assert len(sessions) < 40, "every connection went to one worker"
            session = Session(gw, token)
            sessions.append(session)
            host, port = session.tls.getsockname()[:2]
            client = f"{host}:{port}"
            statuses[client] = [session.get()]
            time.sleep(0.05)
            workers = {r["worker"] for r in map(json.loads, audit.read_bytes().splitlines())
                       if r.get("client") in statuses}
        fill(tmpfs, "filler")
        clients = list(statuses)
        while sum(s.count(503) for s in statuses.values()) < 300:
            for client, session in zip(clients, sessions, strict=True):
                statuses[client].append(session.get())
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(20) == 0
    finally:
        for session in sessions:
            session.close()
        gw.stop()
    first_log = err.all()
    assert first_log.count("they are kept in the spill journal") == 2, first_log[-3000:]
    assert "they are lost" not in first_log and "were dropped" not in first_log
    journal = tmp_path / "gw" / "state" / "audit-spill"
    assert {p.name.split("-")[0] for p in journal.iterdir()} == {"0", "1"}

    (tmpfs / "filler").unlink()
    gw = start_gateway(tmp_path / "gw", {"inspect.test": nginx.port}, test_ca, workers=1,
                       extra=config)
    err = Stderr(gw)
    try:
        assert readyz(gw)[0] == 200
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(15) == 0
    finally:
        gw.stop()
    assert "Traceback" not in first_log + err.all()
    assert list(journal.iterdir()) == []
    lines = [json.loads(line) for line in audit.read_bytes().splitlines()]
    for client, expected in statuses.items():
        assert [r["status"] for r in lines if r.get("client") == client
                and r.get("path") == "/small"] == expected, client
