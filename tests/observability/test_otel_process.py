"""The exporter process (observability/otel_process.py, otel_export.py): a real child
process exporting to a real OTLP receiver what a feed sends it; restarted after it dies,
its lines meanwhile dropped and counted; what is queued exported at the stop; gone when
its worker's socket ends; and the SDK imported there, never in the worker."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.otlp_receiver import OtlpReceiver

from gateway.observability import metrics, otel_process
from gateway.observability.otel_feed import OtelFeed
from gateway.observability.otel_process import ExporterProcess


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # (read by the child's SDK)
    with OtlpReceiver() as server:
        yield server


def _exporter(receiver: OtlpReceiver) -> ExporterProcess:
    return ExporterProcess({"endpoint": receiver.grpc_endpoint, "protocol": "grpc",
                            "headers": {}, "traces": True, "logs": False,
                            "metrics_on": False, "worker": 3}, OtelFeed())


def _write(feed: OtelFeed, host: str) -> None:
    record = {"method": "GET", "host": host, "path": "/", "decision": "allow",
              "usage": None, "mcp": None, "trace": None, "duration_ms": 1.0}
    feed.tap(record, time.time(), (json.dumps(record) + "\n").encode())


def _hosts(receiver: OtlpReceiver) -> list[str]:
    return [s["attributes"]["server.address"] for s in receiver.spans()]


def test_lines_reach_the_collector_and_the_stop_exports_what_is_queued(
        receiver: OtlpReceiver) -> None:
    exporter = _exporter(receiver)

    async def run() -> None:
        exporter.start()
        exporter.watch()
        for n in range(200):
            _write(exporter.feed, f"h{n}.test")
        await exporter.close()  # (flushes the feed, ends the socket; the child exports)

    asyncio.run(run())
    assert exporter.proc is not None and exporter.proc.returncode == 0
    assert sorted(_hosts(receiver)) == sorted(f"h{n}.test" for n in range(200))
    assert {s["resource"]["sandbox_gateway.worker"] for s in receiver.spans()} == {3}
    assert exporter.feed.dropped == 0


def test_a_dead_exporter_is_restarted_and_its_lines_meanwhile_counted(
        receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(otel_process, "WATCH", 0.1)
    monkeypatch.setattr(otel_process, "BACKOFF", (0.3, 1.0))
    exporter = _exporter(receiver)

    async def run() -> None:
        exporter.start()
        exporter.watch()
        _write(exporter.feed, "before.test")
        exporter.feed.flush()
        assert receiver.wait(lambda: _hosts(receiver) == ["before.test"], 20)
        first = exporter.proc
        assert first is not None
        first.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 20
        while exporter.feed.sock is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        _write(exporter.feed, "while-down.test")  # (no exporter: dropped, counted)
        while exporter.restarts == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert exporter.proc is not first and exporter.feed.sock is not None
        _write(exporter.feed, "after.test")
        await exporter.close()

    asyncio.run(run())
    assert _hosts(receiver) == ["before.test", "after.test"]
    assert exporter.feed.dropped == 1 and exporter.restarts == 1


def test_the_exporter_ends_with_its_worker_socket(receiver: OtlpReceiver) -> None:
    """However the worker ends, its socket ends, and so does the exporter."""
    exporter = _exporter(receiver)
    exporter.start()
    assert exporter.proc is not None
    _write(exporter.feed, "last.test")
    exporter.feed.detach()  # (what a worker's exit does to its end)
    assert exporter.proc.wait(20) == 0
    assert _hosts(receiver) == ["last.test"]


@pytest.mark.parametrize(("config", "started"), [
    ("", False), ("telemetry: {endpoint: 'http://127.0.0.1:9'}", True)])
def test_the_sdk_is_imported_only_in_the_exporter(tmp_path: Path, config: str,
                                                  started: bool) -> None:
    """A gateway without `telemetry.endpoint` starts no exporter; with it, the worker
    starts one and still never imports the SDK itself."""
    (tmp_path / "gateway.yaml").write_text(config + "\n")
    script = (
        "import asyncio, io, sys\n"
        "from gateway.config import load_config\n"
        "from gateway.observability.audit import Auditor\n"
        "from gateway.runtime.app import Gateway\n"
        f"cfg = load_config({str(tmp_path / 'gateway.yaml')!r}, env={{}})\n"
        "gw = Gateway(cfg)\n"
        "async def main():\n"
        "    gw.auditor = Auditor.open(stream=io.StringIO())\n"
        "    exporter = gw._otel_exporter()\n"
        "    alive = exporter is not None and exporter.proc.poll() is None\n"
        "    print('opentelemetry.sdk' in sys.modules, exporter is not None, alive,\n"
        "          exporter.proc.pid if exporter else 0, flush=True)\n"
        "    if exporter is not None:\n"
        "        sys.stdin.readline()\n"
        "        await exporter.close()\n"
        "asyncio.run(main())\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        sdk, exists, alive, pid = proc.stdout.readline().split()
        assert (sdk, exists, alive) == ("False", str(started), str(started))
        if started:  # the child has the SDK (its gRPC exporter's native module mapped)
            deadline = time.monotonic() + 30  # (until the child has built its exporters)
            while "cygrpc" not in Path(f"/proc/{pid}/maps").read_text() and \
                    time.monotonic() < deadline:
                time.sleep(0.1)
            assert "cygrpc" in Path(f"/proc/{pid}/maps").read_text()
            assert "cygrpc" not in Path(f"/proc/{proc.pid}/maps").read_text()
            proc.stdin.write("\n")
            proc.stdin.flush()
        assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stdin, proc.stderr):
            if stream is not None:
                stream.close()


def test_what_the_exporter_drops_is_counted_in_the_workers_metrics(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A collector that is down: the exporter process's spans are dropped after the
    retries and reported back; the worker counts each once in
    sandbox_gateway_telemetry_export_dropped_total{signal, reason} (its /metrics)."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    with OtlpReceiver() as gone:  # (a port nothing listens on once it is closed)
        endpoint = gone.grpc_endpoint
    exporter = ExporterProcess({"endpoint": endpoint, "protocol": "grpc", "headers": {},
                                "traces": True, "logs": False, "metrics_on": False},
                               OtelFeed())
    counter = metrics.TELEMETRY_EXPORT_DROPPED.labels("traces", "unreachable")
    before = counter._value.get()

    async def run() -> None:
        exporter.start()
        for n in range(4):
            _write(exporter.feed, f"h{n}.test")
        exporter.feed.flush()
        deadline = time.monotonic() + 20  # (0.2 s batching, 1.5 s of retries, a report)
        while counter._value.get() < before + 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            exporter.reports()
        exporter.reports()  # (a total read again is not counted twice)
        await exporter.close()

    asyncio.run(run())
    assert counter._value.get() == before + 4
    assert b'sandbox_gateway_telemetry_export_dropped_total{reason="unreachable",' \
        b'signal="traces"}' in metrics.exposition()
