"""Batches of OTLP messages sent (observability/otel_send.py) to a real OTLP receiver over
gRPC and HTTP: whole batches at BATCH, a partial one once it waited DELAY, everything
held at the stop; a collector that is down is retried, then its batches dropped, logged
and counted."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from helpers.otlp_receiver import OtlpReceiver

from gateway.observability import otel_encode as otlp
from gateway.observability import otel_send
from gateway.observability.otel_send import BATCH, DELAY, Sender

RESOURCE = otlp.resource({"service.name": "test"})


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as server:
        yield server


def _sender(protocol: str, endpoint: str, queue: int = 8192) -> Sender:
    return Sender("traces", protocol, endpoint, {"x-auth": "v"},
                  lambda spans: otlp.traces_request(RESOURCE, "s", spans), queue)


def _span(n: int) -> object:
    return otlp.span(f"s{n}", otlp.SERVER, b"\x01" * 16, otlp.span_id(), b"", 1, 2, {})


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_batches_reach_the_collector(receiver: OtlpReceiver, protocol: str) -> None:
    endpoint = receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint
    sender = _sender(protocol, endpoint)
    for n in range(BATCH + 10):
        sender.add(_span(n))
    assert receiver.wait(lambda: len(receiver.spans()) == BATCH)  # (a whole batch: now)
    sender.close()  # (the 10 held go at the stop)
    assert sorted(s["name"] for s in receiver.spans()) == sorted(
        f"s{n}" for n in range(BATCH + 10))
    assert len(receiver.received["traces"]) == 2 and sender.dropped == 0


def test_extend_cuts_the_batches_add_cuts(receiver: OtlpReceiver) -> None:
    """`extend` (a datagram's spans at once) sends the requests `add` one by one would:
    whole batches of BATCH in order as soon as they fill, the rest held until the stop."""
    sender = _sender("grpc", receiver.grpc_endpoint)
    sender.extend([])
    sender.extend([_span(n) for n in range(BATCH - 3)])
    sender.extend([_span(n) for n in range(BATCH - 3, 2 * BATCH + 5)])
    assert receiver.wait(lambda: len(receiver.received["traces"]) == 2)
    sender.close()
    names = [[s.name for s in r.resource_spans[0].scope_spans[0].spans]
             for r in receiver.received["traces"]]
    assert names == [[f"s{n}" for n in range(k * BATCH, min((k + 1) * BATCH,
                                                            2 * BATCH + 5))]
                     for k in range(3)]
    assert sender.dropped == 0


def test_a_partial_batch_goes_once_it_waited(receiver: OtlpReceiver) -> None:
    sender = _sender("grpc", receiver.grpc_endpoint)
    sender.add(_span(1))
    sender.tick()  # (too soon)
    time.sleep(DELAY + 0.1)
    assert receiver.spans() == []
    sender.tick()
    assert receiver.wait(lambda: [s["name"] for s in receiver.spans()] == ["s1"])
    sender.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_collector_down_is_retried_then_dropped(
        protocol: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(otel_send, "RETRIES", (0.01, 0.01))
    monkeypatch.setattr(otel_send, "TIMEOUT", 2.0)
    with socket.socket() as probe:  # (a port nothing listens on)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sender = _sender(protocol, f"http://127.0.0.1:{port}")
    for n in range(3):
        sender.add(_span(n))
    sender.close(timeout=20)
    assert sender.dropped == 3 and sender.drops == {"unreachable": 3}
    assert "3 traces not exported" in caplog.text and "x-auth" not in caplog.text


def test_a_collector_that_refuses_is_not_retried_and_counted_as_refused(
        receiver: OtlpReceiver) -> None:
    """An answer that is not retried (HTTP 404: the receiver has no such path)."""
    sender = Sender("traces", "http", receiver.http_endpoint + "/nowhere", {},
                    lambda spans: otlp.traces_request(RESOURCE, "s", spans))
    sender.add(_span(1))
    sender.close(timeout=20)
    assert sender.drops == {"refused": 1} and receiver.spans() == []


def test_a_full_queue_drops_whole_batches_counted_as_queue_full(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(otel_send, "RETRIES", (0.05, 0.05))  # (each batch: 0.1 s at least)
    with socket.socket() as probe:  # (a port nothing listens on: every export is slow)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sender = _sender("http", f"http://127.0.0.1:{port}", queue=BATCH)  # (one batch waits)
    for n in range(BATCH * 4):
        sender.add(_span(n))
    assert sender.drops.get("queue_full", 0) >= BATCH
    assert sender.drops["queue_full"] % BATCH == 0
    sender.close(timeout=20)
    assert sender.dropped == BATCH * 4  # (the others not exported either: unreachable)
