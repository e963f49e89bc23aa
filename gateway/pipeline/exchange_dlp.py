"""Outbound credential detection on an exchange's way out (issue 43, `dlp:`): the head
(request line and headers, the credential carrier already emptied), the body as the
receiver reads it (whole within the hold limit; beyond it streamed through a window kept
across chunks), trailers, and each WebSocket message from the client. The leak guard has
scanned each part first (the gateway's own keys and tokens keep their stricter binding).

What a finding does is the rule's `dlp.action` (`core/dlp/verdict.py` decides): refuse
(`403 secret_detected`), redact (the value replaced, the body re-framed by the engine as
for the metering rewrite; a body streamed past the hold limit cannot be rewritten and is
refused), report (forwarded, recorded). Every finding goes to the audit line's `dlp`.
A body the scan cannot read is refused (fail closed), as is one whose detectors'
expressions outrun their time (`detector.Budget`: each part's scan here has its own, from
its size). Each finding recorded is also counted (`dlp_findings`: detector, action,
engine).

Answers are never refused or rewritten for what they hold (issue 43: directional; a
sandbox may download a `.env` example). Under `answers: report` they are scanned as the
client gets them (echoes of an injected key already redacted): headers, the body
streamed through a window like a large request body, trailers, and each WebSocket
message from the upstream; findings go to the audit line's `dlp` with `where` saying
`answer ...` and action `report`. An answer the scan cannot read (a zstd stream, a
charset it has no codec for, more anchors than it reads, two Content-Types that differ)
is forwarded, as every answer is, and said so on the audit line: a `dlp` entry with
detector `unreadable` and the reason, once for each part of the answer (a hostile
upstream does not keep what it sends out of the report by sending it unreadably).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gateway.core.dlp import (
    Finding,
    Location,
    ScanResult,
    StreamScanner,
    redact_body,
    redact_text,
)
from gateway.core.dlp.detector import Budget
from gateway.core.dlp.fastscan import ChunkPass
from gateway.core.dlp.policy import Action
from gateway.core.dlp.verdict import counted, records, refusal, unreadable
from gateway.core.messages import Headers
from gateway.core.ports import SILENT, Telemetry
from gateway.core.zip_entries import NO_SIGNATURE, local_header
from gateway.pipeline.dlp_plans import Plan

__all__ = ["DlpCheck"]

_NOT_STREAMED = "; dlp.action redact cannot rewrite a body streamed past the hold limit"
RECORDED = 64  # findings an exchange's audit line names, at most (every one is counted)


class DlpCheck:
    """One exchange's detection under its rule's `Plan` (`dlp_plans`: the resolved
    section, its detectors, what a finding does). Made for every request of a rule with
    `dlp:`: it only takes the exchange's own facts (its host and rule for refusals, its
    telemetry and engine for counts, its sandbox for what it sent before)."""

    __slots__ = ("_answer", "_pass", "_stream", "_unread", "answers", "engine", "found",
                 "gate", "host", "plan", "rule", "sandbox", "scanner", "telemetry")

    def __init__(self, plan: Plan, host: str, rule: str | None,
                 telemetry: Telemetry = SILENT, engine: str = "",
                 sandbox: str | None = None) -> None:
        self.plan = plan
        self.scanner = plan.scanner  # (the rule's detectors)
        # The gate's one pass (`Prefilter.gate`), which the leak guard runs first on a
        # body, so that this check takes its answer for the same body.
        self.gate = plan.gate
        self.answers = plan.answers  # (`answers: report`: the answer scanned too)
        self.host = host
        self.rule = rule
        self.found: list[dict[str, Any]] = []  # the audit line's `dlp`
        self.telemetry = telemetry
        self.engine = engine
        self.sandbox = sandbox  # (whose: what it sent before is not read again, `history`)
        self._stream: StreamScanner | None = None
        self._pass: ChunkPass | None = None  # (a streamed body's shared pass)
        self._answer: StreamScanner | None = None
        self._unread: set[str] = set()  # (the parts of the answer said to be unreadable)

    def _judge(self, result: ScanResult, why_not: str | None = None
               ) -> tuple[Finding, ...]:
        """The findings that count, recorded; raises the refusal (refuse, an unreadable
        body, or redact where `why_not` says it cannot be done). Returns what to redact
        (empty: nothing, or reported only)."""
        if result.unreadable is not None:
            raise unreadable(result.unreadable, self.host, self.rule)
        found = counted(self.plan.dlp, result.findings, self.host)
        if not found:
            return ()
        action = self.plan.action
        if action == "redact" and why_not is not None:
            self._record(found, "refuse")
            raise refusal(found, self.host, self.rule, self.found, why_not)
        self._record(found, action)
        if action == "refuse":
            raise refusal(found, self.host, self.rule, self.found)
        return found if action == "redact" else ()

    def _record(self, found: tuple[Finding, ...], action: Action) -> None:
        """Findings onto the audit line's `dlp` (the first `RECORDED`: a body of many
        distinct keys, a sandbox's in report mode or an upstream's answer, makes no
        unbounded line), and each counted."""
        room = RECORDED - len(self.found)
        if room > 0:
            self.found += records(found[:room], action)
        for finding in found:
            self.telemetry.count("dlp_findings", finding.detector, action, self.engine)

    def head(self, method: str, path: str, headers: Headers) -> str:
        """The request line and headers; returns the path to send (redacted: the
        header values are rewritten in place). A head without a candidate (most) costs
        one gate pass over its new parts (`Scanner.unclean_fields`); one with some, the
        scan of the fields that hold them."""
        if headers.count("content-type") > 1 and len(set(headers.get_all("content-type"))) > 1:
            # (a receiver may read the body by either: which one hides what is not known)
            raise unreadable("the request names more than one Content-Type; send one",
                             self.host, self.rule)
        unclean = self.scanner.unclean_fields(method, path, headers.fields)
        if unclean is None:
            return path
        with Budget(len(path) + _size(headers.fields)):
            return self._head(method, path, headers, unclean)

    def _head(self, method: str, path: str, headers: Headers,
              unclean: list[tuple[bytes, bytes]]) -> str:
        found = self._judge(self.scanner.scan_request(method, path, _text(unclean)))
        if not found:
            return path
        fields = _text(headers.fields)
        out: list[tuple[bytes, bytes]] = []
        for name, value in fields:
            text = redact_text(self.scanner, value, Location("header", name))
            if text is None:
                raise refusal(found, self.host, self.rule, self.found,
                              "; it cannot be redacted from the header")
            out.append((name.encode("latin-1"), text[0].encode("latin-1")))
        headers.fields = out
        line = redact_text(self.scanner, path, Location("request line"))
        if line is None:
            raise refusal(found, self.host, self.rule, self.found,
                          "; it cannot be redacted from the request line")
        return line[0]

    def whole(self, plain: bytes | None, content_type: str | None) -> bytes | None:
        """A body held whole, decoded (None: it decodes past the hold limit). Returns
        the body to send instead (redacted), or None."""
        if plain is None:
            raise unreadable("the body decodes to more than the hold limit", self.host,
                             self.rule)
        gated = len(plain) <= self.scanner.limit
        if gated and self.scanner.body_clean(plain, content_type):
            return None  # (most bodies: one gate pass over their bytes)
        with Budget(len(plain)):
            return self._whole(plain, content_type, gated)

    def _whole(self, plain: bytes, content_type: str | None, gated: bool) -> bytes | None:
        found = self._judge(self.scanner.scan_body(plain, content_type, gated=gated,
                                                   sandbox=self.sandbox))
        if not found:
            return None
        redacted = redact_body(self.scanner, plain, content_type)
        if redacted.body is None:
            raise refusal(found, self.host, self.rule, self.found,
                          f"; it cannot be redacted ({redacted.reason})")
        return redacted.body

    # -- a body streamed (past the hold limit, or of unknown length) -----------------------

    def passed(self, piece: bytes) -> int:
        """The gate's pass over the next piece of the streamed body (`ChunkPass`): the
        leak guard takes its `RUN` and the escapes it saw (`leaks.StreamScan.feed`),
        then `feed` the rest of the answer, one pass serving both; and `NO_SIGNATURE`
        where no zip entry begins in it (`zip_entries`: both read a body's files)."""
        if self._pass is None:
            self._pass = ChunkPass(self.gate)
        flags: int = self._pass.flags(piece, escapes=True)
        return flags | NO_SIGNATURE if local_header(piece) < 0 else flags

    def feed(self, piece: bytes, content_type: str | None = None,
             flags: int | None = None) -> None:
        """A piece of the streamed body, decoded (`content_type`: the body's, read at
        the first piece; `flags`: `passed(piece)`, None if not asked)."""
        stream = self._stream
        if stream is None:  # (unpacked too where it, or a part, is an archive)
            stream = self._stream = StreamScanner(self.scanner, content_type=content_type,
                                                  unpack=True)
        if flags is not None and stream.passes(piece, flags):
            return  # (nothing in it the expressions need to read: most pieces)
        with Budget(len(piece) + stream.pending):
            self._judge(stream.feed(piece, flags), _NOT_STREAMED)

    @property
    def pending(self) -> int:
        """Bytes at the end of the stream not scanned yet (held back, not forwarded)."""
        return self._stream.pending if self._stream is not None else 0

    def end(self) -> None:
        if self._stream is not None:
            with Budget(self._stream.pending):
                self._judge(self._stream.end(), _NOT_STREAMED)

    def trailers(self, fields: list[tuple[bytes, bytes]]) -> None:
        with Budget(_size(fields)):
            self._judge(self.scanner.scan_request("", "", _text(fields)),
                        "; dlp.action redact cannot rewrite trailers")

    def message(self, data: bytes) -> bytes:
        """A WebSocket message from the client: the message to send."""
        if len(data) <= self.scanner.limit and self.scanner.body_clean(data, None):
            return data
        with Budget(len(data)):
            return self._message(data)

    def _message(self, data: bytes) -> bytes:
        found = self._judge(self.scanner.scan_body(data, sandbox=self.sandbox))
        if not found:
            return data
        redacted = redact_body(self.scanner, data)
        if redacted.body is None:
            raise refusal(found, self.host, self.rule, self.found,
                          f"; it cannot be redacted ({redacted.reason})")
        return redacted.body

    # -- the answer (`answers: report`): what is found is recorded, nothing refused ---------

    def answer_head(self, fields: list[tuple[bytes, bytes]]) -> None:
        """The answer's headers as the client gets them."""
        types = {v.strip().lower() for k, v in fields if k.lower() == b"content-type"}
        if len(types) > 1:  # (the client reads the body by either: `head`)
            self._unreadable("the answer names more than one Content-Type", "body")
        if self.scanner.head_clean("", "", fields):
            return
        with Budget(_size(fields)):
            self._flag_result(self.scanner.scan_request("", "", _text(fields)), "header")

    def answer_data(self, piece: bytes, content_type: str | None,
                    content_encoding: str | None) -> None:
        """The next piece of the answer's body as the client gets it (`content_type`
        and `content_encoding`: the head's as sent, read at the first piece)."""
        if self._answer is None:
            self._answer = StreamScanner(self.scanner, content_encoding, "answer body",
                                         content_type)
        with Budget(len(piece) + self._answer.pending):
            self._flag_result(self._answer.feed(piece), "body")

    def answer_end(self, trailers: list[tuple[bytes, bytes]] | None = None) -> None:
        """The answer's end: what is left of its body's window, and its trailers."""
        if self._answer is not None:
            with Budget(self._answer.pending):
                self._flag_result(self._answer.end(), "body")
            self._answer = None
        if trailers:
            with Budget(_size(trailers)):
                self._flag_result(self.scanner.scan_request("", "", _text(trailers)),
                                  "trailer", "trailer")

    def answer_message(self, data: bytes) -> None:
        """A WebSocket message from the upstream."""
        if len(data) <= self.scanner.limit and self.scanner.body_clean(data, None):
            return
        with Budget(len(data)):
            self._flag_result(self.scanner.scan_body(data), "message", "message")

    def _flag_result(self, result: ScanResult, where: str, part: str | None = None) -> None:
        """A scan of a part of the answer (`where`: which, for an unreadable one)."""
        self._flag(result.findings, part)
        if result.unreadable is not None:
            self._unreadable(result.unreadable, where)

    def _unreadable(self, why: str, where: str) -> None:
        """An answer's part the scan cannot read: said once on the audit line (`dlp`:
        detector `unreadable`, the reason) and counted; the answer goes on."""
        if where in self._unread:
            return
        self._unread.add(where)
        if len(self.found) < RECORDED:
            self.found.append({"detector": "unreadable", "where": f"answer {where}",
                               "reason": why[:200], "action": "report"})
        self.telemetry.count("dlp_findings", "unreadable", "report", self.engine)

    def _flag(self, findings: tuple[Finding, ...], part: str | None = None) -> None:
        """Findings in the answer that count on this host, recorded as reported, where
        each was said as `answer ...` (`part`: instead of the scan's own)."""
        found = counted(self.plan.dlp, findings, self.host)
        if found:
            self._record(tuple(replace(f, location=replace(
                f.location, part=_answer_part(part or f.location.part)))
                for f in found), "report")


def _size(fields: list[tuple[bytes, bytes]]) -> int:
    """What a scan of header fields reads (its time bound's size: `detector.Budget`)."""
    return sum(len(k) + len(v) for k, v in fields)


def _text(fields: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """Header fields as the scanner reads them (latin-1: each byte one character)."""
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in fields]


def _answer_part(part: str) -> str:
    return part if part.startswith("answer") else f"answer {part}"
