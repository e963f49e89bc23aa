"""An exchange's detection (`DlpCheck`) against a hostile other side: the audit line
names a bounded number of findings however many distinct keys a body or an answer holds,
and counts every one; an answer is never refused for what it holds."""

from __future__ import annotations

import random

from gateway.core.dlp import DEFAULT, Dlp, Scanner
from gateway.pipeline.dlp_plans import Plan
from gateway.pipeline.exchange_dlp import RECORDED, DlpCheck
from gateway.services.dlp.library import build

SCANNER = Scanner(build(DEFAULT), b"test-salt")


class Counts:
    def __init__(self) -> None:
        self.counted: list[tuple[str, ...]] = []

    def count(self, event: str, *labels: str, by: float = 1) -> None:
        self.counted.append((event, *labels))

    def gauge(self, name: str, delta: float) -> None:
        pass

    def observe(self, name: str, value: float) -> None:
        pass


def _keys(n: int) -> bytes:
    rng = random.Random(11)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
    return "".join(f"key{i} = AKIA{''.join(rng.choice(alphabet) for _ in range(16))}\n"
                   for i in range(n)).encode()


def test_an_answer_of_many_distinct_keys_is_recorded_bounded_and_counted_whole() -> None:
    counts = Counts()
    check = DlpCheck(Plan(SCANNER, Dlp(action="refuse", answers=True)), "up.test", "p.yaml:3",
                     telemetry=counts, engine="h1")
    body = _keys(500)
    for at in range(0, len(body), 4096):  # (never raises: answers are not refused)
        check.answer_data(body[at:at + 4096], "text/plain", None)
    check.answer_end()
    assert len(check.found) == RECORDED
    assert {(f["detector"], f["action"]) for f in check.found} == {("aws", "report")}
    assert all(f["where"].startswith("answer body") for f in check.found)
    assert counts.counted.count(("dlp_findings", "aws", "report", "h1")) == 500


def test_a_reported_request_of_many_keys_is_recorded_bounded_too() -> None:
    counts = Counts()
    check = DlpCheck(Plan(SCANNER, Dlp(action="report")), "up.test", "p.yaml:3", telemetry=counts)
    assert check.whole(_keys(300), "text/plain") is None  # (forwarded as it is)
    assert len(check.found) == RECORDED
    assert counts.counted.count(("dlp_findings", "aws", "report", "")) == 300


def test_a_request_naming_two_content_types_is_refused_unread() -> None:
    """A receiver reads the body by either; the same one twice is one."""
    from gateway.core.dlp.verdict import SecretDetected
    from gateway.core.messages import Headers

    check = DlpCheck(Plan(SCANNER, Dlp(action="refuse")), "up.test", "p.yaml:3")
    two = Headers.of(("Content-Type", "application/x-www-form-urlencoded"),
                     ("Content-Type", "application/json"))
    try:
        check.head("POST", "/x", two)
    except SecretDetected as refused:
        assert "more than one Content-Type" in str(refused)
    else:
        raise AssertionError("not refused")
    same = Headers.of(("Content-Type", "application/json"), ("content-type", "application/json"))
    assert check.head("POST", "/x", same) == "/x"


def test_an_answer_the_scan_cannot_read_is_said_once_per_part_and_counted() -> None:
    """`answers: report`: an answer's body or message the scan cannot read (in a coding
    no reader here undoes, more anchors than it reads) is never refused, and the audit
    line says so once for each part however many pieces or messages follow (detector
    `unreadable`, the reason), each counted once."""
    counts = Counts()
    check = DlpCheck(Plan(SCANNER, Dlp(action="refuse", answers=True)), "up.test", "p.yaml:3",
                     telemetry=counts, engine="h1")
    coded = _keys(50)
    for at in range(0, len(coded), 100):
        check.answer_data(coded[at:at + 100], "text/plain", "compress")
    check.answer_end()
    flood = b"://" * 200_000
    for _ in range(3):
        check.answer_message(flood)
    assert [(f["detector"], f["where"], f["action"]) for f in check.found] == [
        ("unreadable", "answer body", "report"), ("unreadable", "answer message", "report")]
    assert "compress" in check.found[0]["reason"] and "anchors" in check.found[1]["reason"]
    assert counts.counted.count(("dlp_findings", "unreadable", "report", "h1")) == 2


def test_an_answer_naming_two_content_types_is_said_unreadable_and_still_read() -> None:
    check = DlpCheck(Plan(SCANNER, Dlp(action="refuse", answers=True)), "up.test", "p.yaml:3")
    check.answer_head([(b"Content-Type", b"text/plain"), (b"content-type", b"Text/Plain "),
                       (b"X-A", b"1")])
    assert not check.found  # (the same type twice is one)
    check.answer_head([(b"Content-Type", b"text/plain"), (b"Content-Type", b"application/json")])
    check.answer_data(_keys(1), "text/plain", None)
    check.answer_end()
    assert [(f["detector"], f["where"]) for f in check.found] == [
        ("unreadable", "answer body"), ("aws", "answer body at offset 7")]
