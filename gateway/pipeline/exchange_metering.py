"""An exchange on a credential rule, metered: the body stage's metering step before
forwarding (`core/body_stage.metering_stage`: model allowlists, what cannot be metered,
budgets), the answer's usage read as it is relayed, a provider-minted secret's answer
held and released with aliases, a WebSocket session's messages and events, and the
count when it ends (the `Metering` port: `services/metering`)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from gateway.core.body_stage import metering_stage
from gateway.core.metering import classify, model_in_body
from gateway.core.metering.models import named_models
from gateway.core.metering.refusals import refusal as step_refusal
from gateway.core.metering.usage import RESPONSE_HOLD
from gateway.core.policy import Policy
from gateway.core.policy.model import records_only
from gateway.core.ports import MeteredCall, Metering
from gateway.core.refusal import MessageRefused, Refusal, ws_error
from gateway.core.trail import rule_of
from gateway.pipeline.exchange_state import ExchangeState

__all__ = ["Held", "MeteredSteps"]

# A session's first response asked for, and its first output (time to first chunk):
# a Realtime or Responses-WebSocket ``response.create``, and a ``response.*delta`` event
_CREATE = re.compile(rb'"type"\s*:\s*"response\.create"')
_DELTA = re.compile(rb'"type"\s*:\s*"response\.[a-z_.]*delta"')


class Held(Refusal):
    """A model the rule's allowlist refuses that a person may allow (ask mode); a
    Refusal, so what cannot wait for the answer refuses it."""

    def __init__(self, refusal: Refusal, model: str) -> None:
        super().__init__(refusal.code, refusal.reason, refusal.rule,
                         retry_after=refusal.retry_after)
        self.model = model


class MeteredSteps:
    """The metering side of one credential exchange (see the module docstring)."""

    def __init__(self, ex: ExchangeState, metering: Metering, policy: Policy,
                 preset: str | None) -> None:
        self.ex = ex
        self.metering = metering
        self.policy = policy
        self.preset = preset
        self.metered: MeteredCall | None = None  # what the step admitted
        self.feed: Callable[[bytes], None] | None = None  # the meter's, per chunk
        self.held: list[bytes] | None = None  # an answer read before relaying
        self.first_chunk: float | None = None  # when the answer's first body chunk came
        self.asked: float | None = None  # a session's first response.create relayed
        self.streamed = False  # the answer streams (core/metering/streams.py)

    def reads_body(self) -> bool:
        """The step needs the body whole: an inference call, or a model allowlist
        reading the body."""
        rule = self.ex.decision.rule
        method, path = self.ex.head.method, self.ex.target.path
        return rule is not None and (classify(method, path) is not None
                                     or model_in_body(rule, method, path))

    def admit(self, body: bytes | None, *, granted: str | None = None,
              asks: bool = False) -> tuple[bytes | None, bool]:
        """The step before forwarding: returns the body to forward instead (usage asked
        for on a stream) or None, and whether the step goes on (False: only recorded,
        ``mode: report``). `granted`: a model a person allowed besides the rule's (ask
        mode); `asks`: a person may be asked, so a model the allowlist refuses that a
        person may allow raises `Held`. Raises the refusal."""
        ex = self.ex
        rule = ex.decision.rule
        assert rule is not None
        if (rule.models is not None or self.policy.mode == "learn") and ex.models is None:
            # (replay decides them again; `policy learn` lists them)
            ex.models = list(named_models(ex.head.method, ex.target.path, body))
        stage = metering_stage(self.metering, self.policy, rule, sandbox=ex.identity.sandbox,
                               preset=self.preset, method=ex.head.method,
                               path=ex.target.path, body=body, now=ex.trail.clock(),
                               granted=granted)
        if stage.refusal is not None:
            if stage.report:  # mode: report: forward, record the would-deny
                ex.report = stage.refusal
                return None, False
            if asks and stage.ask is not None:
                raise Held(stage.refusal, stage.ask)
            raise stage.refusal
        step = self.metered = stage.admitted
        assert step is not None
        if step.capture is not None:
            self.feed = step.feed
        elif step.meter is not None:
            self.feed = step.meter.feed
        if step.holds_response:
            self.held = []
        return step.body, True

    # -- the answer ----------------------------------------------------------------------

    def hold(self, out: bytes) -> bytes:
        """A chunk of an answer held until it is whole (a provider-minted secret's):
        nothing goes to the client yet (raises Refusal past `RESPONSE_HOLD`)."""
        held = self.held
        if held is None:
            return out
        held.append(out)
        if sum(map(len, held)) > RESPONSE_HOLD:
            raise Refusal("upstream_failed", f"the upstream {self.ex.where()} answered a "
                          f"secret-minting call with more than {RESPONSE_HOLD} bytes")
        return b""

    def release(self, out: bytes) -> bytes:
        """The end of the answer: a held one whole, each provider-minted secret in it
        replaced by an alias (raises `minted_secret_refused` when it cannot be)."""
        held = self.held
        if held is None or self.metered is None:
            return out
        self.held = None
        head = self.ex.response_head
        released = self.metering.release(self.metered, head.status if head else 0,
                                         b"".join(held) + out, self.ex.trail.clock())
        if isinstance(released, str):
            raise Refusal("minted_secret_refused", released, rule_of(self.ex.decision))
        return released

    # -- a WebSocket session ---------------------------------------------------------------

    def message(self, data: bytes) -> None:
        """A message from the sandbox in a metered session: one a model allowlist or a
        used-up budget refuses is audited (the session goes on, its own line comes when
        it ends) and answered as the provider's error event (raises MessageRefused);
        under ``mode: report`` it is only recorded."""
        if self.metered is None:
            return
        now = self.ex.trail.clock()
        step = self.metering.session_message(self.metered, data, now)
        if step is not None:
            refusal = step_refusal(step)
            if not records_only(self.policy.mode):
                self.ex.audit_message(refusal)
                meter = self.metered.meter
                session = meter.format if meter is not None else "realtime"
                raise MessageRefused(refusal, ws_error(refusal, session,
                                                       stream_id=_lane(data)))
            self.ex.report = refusal
        if self.asked is None and _CREATE.search(data):
            self.asked = now

    def event(self, data: bytes) -> None:
        """A server event of a metered session (a response that ends is counted); the
        first output after the first response asked for is its first chunk."""
        if self.metered is not None:
            now = self.ex.trail.clock()
            if self.asked is not None and self.first_chunk is None and _DELTA.search(data):
                self.first_chunk, self.streamed = now, True
            self.metering.session_event(self.metered, data, now)

    def complete(self) -> dict[str, Any] | None:
        """The step at the end (once): the audit line's ``usage``. It counts what the
        upstream answered (0: no answer, a stream that may still have used its
        reservation), not the status the gateway put on the line."""
        if self.metered is None:
            return None
        head = self.ex.response_head
        record = self.metering.complete(self.metered, head.status if head else 0,
                                        self.ex.trail.clock(), sent=not self.ex.unsent
                                        ).as_record()
        if record is not None and self.streamed and self.first_chunk is not None:
            # time to first token: from the request's start (a session's first response
            # asked for) to the answer's first chunk
            start = self.asked if self.asked is not None else self.ex.started
            record["first_chunk_ms"] = round((self.first_chunk - start) * 1000, 3)
        return record


def _lane(data: bytes) -> str | None:
    """The ``stream_id`` a refused Responses WebSocket event named (its answer's lane)."""
    if b'"stream_id"' not in data:
        return None
    try:
        lane = json.loads(data).get("stream_id")
    except (ValueError, AttributeError):
        return None
    return lane if isinstance(lane, str) else None
