"""Deferred jobs (background responses, batches): a job started through the gateway is
remembered by its id (a counter per day, kept `_DEFERRED_DAYS`), so that retrieving its
result through the gateway meters it, once."""

from __future__ import annotations

import json
import math

from gateway.core.metering.endpoints import Endpoint, route
from gateway.core.metering.jsondoc import document
from gateway.services.metering.exchange import Exchange
from gateway.services.state.counters import Counters

__all__ = ["DeferredJobs"]

_DEFERRED_DAYS = 8  # a deferred job's usage is metered if retrieved within this many days
_JSON = json.JSONDecoder()


class DeferredJobs:
    """The jobs started here and not yet metered, in ``counters``."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters

    @staticmethod
    def _job_key(credential: str, job: str, job_id: str) -> str:
        return f"{credential}:{job}:{job_id}"

    def started(self, exchange: Exchange, status: int, now: float) -> None:
        """A deferred job was started: remember its id, so that retrieving its result
        through the gateway meters it (once)."""
        parts, exchange.capture = exchange.capture or [], None
        if not 200 <= status < 300 or exchange.deferred is None:
            return
        try:
            doc = document(b"".join(parts), _JSON)
        except ValueError:
            return
        job_id = doc.get("id") if isinstance(doc, dict) else None
        if not isinstance(job_id, str) or not 0 < len(job_id) <= 200:
            return
        day = math.floor(now / 86400)
        self.counters.count([(f"jobs:{day}", self._job_key(exchange.credential,
                                                           exchange.deferred, job_id), 1,
                              (day + _DEFERRED_DAYS + 1) * 86400.0)])

    def retrieved(self, credential: str, endpoint: Endpoint, path: str,
                  now: float) -> str | None:
        """The key of the job a retrieval reads, if it was started here and not yet
        metered."""
        parts = route(path).split("/")
        if endpoint.format == "jsonl":  # /v1/messages/batches/{id}/results
            job, job_id = "msgbatch", parts[-2]
        elif "/batches/" in route(path):
            job, job_id = "batch", parts[-1]
        else:
            job, job_id = "response", parts[-1]
        key = self._job_key(credential, job, job_id)
        day = math.floor(now / 86400)
        for back in range(_DEFERRED_DAYS + 1):
            if self.counters.counter(f"jobs:{day - back}", key) > 0:
                return key
        return None

    def forget(self, key: str, now: float) -> None:
        day = math.floor(now / 86400)
        for back in range(_DEFERRED_DAYS + 1):
            table = f"jobs:{day - back}"
            if self.counters.counter(table, key) > 0:
                self.counters.count([(table, key, -1, (day - back + _DEFERRED_DAYS + 1)
                                      * 86400.0)])
                return
