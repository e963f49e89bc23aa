"""Every Prometheus metric the gateway exports, declared in one place.

Labels never carry a token, a secret or a free-form path: only names from
policy files, fixed codes and store names, so cardinality stays bounded.
"""

import os
from collections.abc import Mapping
from functools import lru_cache

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)
MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
"""Worker processes (`run --workers N`) share values through prometheus_client's
multiprocess files; each worker's /metrics then reports the sum over all workers."""


def exposition() -> bytes:
    """The text exposition of every metric (all workers' when there are several).
    prometheus_client's exposition and multiprocess modules are imported at the first
    call, not by a process that is never scraped (`patches.LEAN`)."""
    from prometheus_client import multiprocess
    from prometheus_client.exposition import generate_latest

    if MULTIPROCESS:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry)
    return generate_latest(REGISTRY)


def content_type() -> str:
    """The media type of `exposition()`'s text (prometheus_client's latest)."""
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    return CONTENT_TYPE_LATEST


@lru_cache(maxsize=4096)
def child(metric: Counter, *values: str) -> Counter:
    """`metric.labels(*values)`, remembered: the per-request call sites skip the label
    lookup (its lock and validation)."""
    return metric.labels(*values)

REQUESTS = Counter(
    "sandbox_gateway_requests_total",
    "Decisions taken, by policy, decision and path (passthrough or intercept).",
    ["policy", "decision", "path"],
    registry=REGISTRY,
)
DECISION_SECONDS = Histogram(
    "sandbox_gateway_decision_seconds",
    "Time to take one policy decision.",
    buckets=(1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 5e-4, 1e-3, 1e-2),
    registry=REGISTRY,
)
TOKENS_REFUSED = Counter(
    "sandbox_gateway_tokens_refused_total",
    "Tokens refused, by reason code.",
    ["reason"],
    registry=REGISTRY,
)
TOKENS_ISSUED = Counter(
    "sandbox_gateway_tokens_issued_total",
    "Tokens minted or refreshed through the admin API.",
    ["kind"],
    registry=REGISTRY,
)
OPEN_CONNECTIONS = Gauge(
    "sandbox_gateway_open_connections",
    "Client connections currently open.",
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
POLICY_RELOADS = Counter(
    "sandbox_gateway_policy_reloads_total",
    "Policy (re)loads, by result (ok or error).",
    ["result"],
    registry=REGISTRY,
)
SIGNING_KEY_RELOADS = Counter(
    "sandbox_gateway_signing_key_reloads_total",
    "Signing-key directory reloads after a change, by result (ok or error).",
    ["result"],
    registry=REGISTRY,
)
POLICY_RULES = Gauge(
    "sandbox_gateway_policy_rules",
    "Egress rules in the policy set now serving.",
    registry=REGISTRY,
    multiprocess_mode="livemax",
)
POLICY_INFO = Gauge(
    "sandbox_gateway_policy_info",
    "1 for the revision of the policy set now serving (git commit, REVISION file or "
    "sha256 of the files).",
    ["revision"],
    registry=REGISTRY,
    multiprocess_mode="livemax",
)
UPSTREAM_PROXY_CONNECTS = Counter(
    "sandbox_gateway_upstream_proxy_connects_total",
    "Dials through network.upstream_proxy, by outcome: ok, denied (the proxy's 403, "
    "SOCKS not allowed), auth_failed (407, SOCKS authentication), refused (another "
    "answer), unreachable, tls (the proxy's certificate), timeout, protocol_error, "
    "credentials_unavailable, error.",
    ["outcome"],
    registry=REGISTRY,
)
UPSTREAM_CONNECTIONS = Counter(
    "sandbox_gateway_upstream_connections_total",
    "Upstream connections an intercepted request went out on that its client connection "
    "did not already hold: dialled (new) or pooled (kept from an earlier connection of "
    "the same sandbox to the same destination).",
    ["how"],
    registry=REGISTRY,
)
DESTINATIONS_REFUSED = Counter(
    "sandbox_gateway_destinations_refused_total",
    "Upstream addresses refused after resolution, by classification code.",
    ["code"],
    registry=REGISTRY,
)
BYTES = Counter(
    "sandbox_gateway_bytes_total",
    "Body bytes relayed for intercepted requests, by direction (in = from upstream).",
    ["direction"],
    registry=REGISTRY,
)
SECRET_FETCHES = Counter(
    "sandbox_gateway_secret_fetches_total",
    "Secret store fetches, by store and result (ok, not_found, error, throttled).",
    ["store", "result"],
    registry=REGISTRY,
)
SECRET_FETCH_SECONDS = Histogram(
    "sandbox_gateway_secret_fetch_seconds",
    "Latency of one secret store fetch.",
    ["store"],
    registry=REGISTRY,
)
SECRET_CACHE = Counter(
    "sandbox_gateway_secret_cache_total",
    "Secret cache lookups, by outcome (hit, miss, stale, unavailable).",
    ["outcome"],
    registry=REGISTRY,
)
CREDENTIAL_MINTS = Counter(
    "sandbox_gateway_credential_mints_total",
    "Credentials minted by the gateway (GitHub App, Entra ID, AWS, Google, OAuth2), by "
    "credential type and result (ok, error).",
    ["type", "result"],
    registry=REGISTRY,
)
CREDENTIALS_INJECTED = Counter(
    "sandbox_gateway_credentials_injected_total",
    "Credentials swapped into requests, by credential name.",
    ["credential"],
    registry=REGISTRY,
)
EXFILTRATION_BLOCKED = Counter(
    "sandbox_gateway_exfiltration_blocked_total",
    "Requests refused for carrying a token or secret to an unbound host, by kind.",
    ["kind"],
    registry=REGISTRY,
)
DLP_FINDINGS = Counter(
    "sandbox_gateway_dlp_findings_total",
    "Credentials the gateway did not issue found in requests (outbound credential "
    "detection, `dlp:`), by detector, the action taken (refuse, redact, report) and engine; "
    "never a value or a fingerprint.",
    ["detector", "action", "engine"],
    registry=REGISTRY,
)
DNS_QUERIES = Counter(
    "sandbox_gateway_dns_queries_total",
    "Queries to the gateway's DNS resolver (listen.dns), by policy and result: allow, "
    "report, or the refusal code (policy_denied, type_refused, unknown_sandbox, "
    "rate_limited, forbidden_destination, unresolvable, malformed, ...).",
    ["policy", "result"],
    registry=REGISTRY,
)
STATE_STORE_UP = Gauge(
    "sandbox_gateway_state_store_up",
    "1 while the shared state store is reachable and in sync; 0 = serving the last "
    "known revocations and sandboxes, refusing changes.",
    ["store"],
    registry=REGISTRY,
    multiprocess_mode="livemin",
)
STATE_STORE_ERRORS = Counter(
    "sandbox_gateway_state_store_errors_total",
    "Shared state store failures, by operation (connect, listen, revoke, register, "
    "unregister, decode).",
    ["op"],
    registry=REGISTRY,
)
INFERENCE_TOKENS = Counter(
    "sandbox_gateway_inference_tokens_total",
    "Tokens of metered inference exchanges, by policy, credential, model and kind (input, "
    "output, cached: the cached part of the input). Models beyond a bounded set are "
    "`other`.",
    ["policy", "credential", "model", "kind"],
    registry=REGISTRY,
)
INFERENCE_REQUESTS = Counter(
    "sandbox_gateway_inference_requests_total",
    "Metered inference exchanges, by policy, credential, model and HTTP status (`error` "
    "when no response arrived; model `unknown` when neither side named one).",
    ["policy", "credential", "model", "status"],
    registry=REGISTRY,
)
BUDGET_REFUSALS = Counter(
    "sandbox_gateway_budget_refusals_total",
    "Requests refused because a budget was used up, by policy and budget.",
    ["policy", "budget"],
    registry=REGISTRY,
)
APPROVALS = Counter(
    "sandbox_gateway_approvals_total",
    "Ask mode: approvals by result (asked, approved, denied, timeout, revoked: a grant, "
    "limited: not asked, the sandbox had too many asks waiting).",
    ["result"],
    registry=REGISTRY,
)
APPROVALS_PENDING = Gauge(
    "sandbox_gateway_approvals_pending",
    "Ask mode: requests held now, waiting for a person's answer.",
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
APPROVAL_WAIT = Histogram(
    "sandbox_gateway_approval_wait_seconds",
    "Ask mode: how long a held request waited for its answer (or its timeout).",
    buckets=(0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600),
    registry=REGISTRY,
)
APPROVAL_NOTIFICATIONS = Counter(
    "sandbox_gateway_approval_notifications_total",
    "Ask mode: notifications by notifier and result (sent, failed, unknown: no such "
    "notifier in approvals.notify).",
    ["notifier", "result"],
    registry=REGISTRY,
)
MCP_CALLS = Counter(
    "sandbox_gateway_mcp_calls_total",
    "MCP JSON-RPC calls on rules with mcp:, by policy and decision (allow, deny).",
    ["policy", "decision"],
    registry=REGISTRY,
)
MODEL_REFUSALS = Counter(
    "sandbox_gateway_model_refusals_total",
    "Requests refused by a rule's model allowlist, by policy and credential.",
    ["policy", "credential"],
    registry=REGISTRY,
)
METERING_REFUSALS = Counter(
    "sandbox_gateway_metering_refusals_total",
    "Inference calls refused because their usage could not be metered "
    "(metering_unavailable) or a provider would mint a secret (minted_secret_refused), "
    "by policy and code.",
    ["policy", "code"],
    registry=REGISTRY,
)
RESERVATIONS_CHARGED = Counter(
    "sandbox_gateway_metering_reservations_charged_total",
    "Metered calls whose usage never arrived (a stream cut off, an answer without usage) "
    "and were counted at their reservation against budgets, by policy and credential.",
    ["policy", "credential"],
    registry=REGISTRY,
)
RESERVATIONS_ORPHANED = Counter(
    "sandbox_gateway_budget_orphaned_reservations_total",
    "Reservations of calls whose gateway process ended without settling them (killed, "
    "or its lease expired) that this process charged in full as used: one per budget "
    "window and subject of the dead process.",
    registry=REGISTRY,
)
SECRET_STALE = Gauge(
    "sandbox_gateway_secret_stale_seconds",
    "How long past its freshness a secret is being served because refreshing it fails "
    "(0 = fresh), by secret name.",
    ["secret"],
    registry=REGISTRY,
    multiprocess_mode="livemax",
)
AUDIT_UP = Gauge(
    "sandbox_gateway_audit_up",
    "1 while audit lines are written; 0 while they cannot be (a write error, or a blocked "
    "output filling audit.buffer): new exchanges are then refused 503 audit_unavailable "
    "(audit.on_failure: refuse).",
    registry=REGISTRY,
    multiprocess_mode="livemin",
)
AUDIT_HELD = Gauge(
    "sandbox_gateway_audit_held_bytes",
    "Bytes of audit lines held because the output does not take them now (set when writing "
    "stalls or fails, and when it resumes).",
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
AUDIT_SPILLED = Gauge(
    "sandbox_gateway_audit_spilled_bytes",
    "Bytes of audit lines in the spill journal (audit.spill.path): lines the output did "
    "not take that did not fit in audit.buffer, or were held at the stop; written to the "
    "output before newer lines.",
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
MEMORY_RSS = Gauge(
    "sandbox_gateway_memory_rss_bytes",
    "Resident memory of each gateway process (a series per worker pid), read every second.",
    registry=REGISTRY,
    multiprocess_mode="liveall",
)
MEMORY_CEILING = Gauge(
    "sandbox_gateway_memory_ceiling_bytes",
    "Each worker's memory ceiling (limits.memory; 0: none): above it new connections are "
    "refused 503 at_capacity.",
    registry=REGISTRY,
    multiprocess_mode="liveall",
)
MEMORY_RELEASES = Counter(
    "sandbox_gateway_memory_releases_total",
    "Times a worker returned freed memory to the system (malloc_trim), by reason: burst (a "
    "burst of connections closed), growth, ceiling (above limits.memory).",
    ["reason"],
    registry=REGISTRY,
)
MEMORY_RELEASED = Counter(
    "sandbox_gateway_memory_released_bytes_total",
    "Resident memory the releases gave back to the system.",
    registry=REGISTRY,
)
STATE_VOLUME_FREE = Gauge(
    "sandbox_gateway_state_volume_free_bytes",
    "Free bytes (for the gateway's user) on the volume of the SQLite state file, read every "
    "state.volume_check (10 s by default); /readyz warns below the threshold "
    "(docs/operations.md).",
    registry=REGISTRY,
    multiprocess_mode="livemin",
)
STATE_FILE_BYTES = Gauge(
    "sandbox_gateway_state_file_bytes",
    "Size of the SQLite store's files, by file: state (the state file), state_wal, log (the "
    "console's request log), log_wal.",
    ["file"],
    registry=REGISTRY,
    multiprocess_mode="livemax",
)
REQUEST_LOG_DROPPED = Counter(
    "sandbox_gateway_request_log_dropped_lines_total",
    "Audit lines left out of the console's request log: more than its hold waited while "
    "the state store did not take them (the audit trail itself is complete).",
    registry=REGISTRY,
)
TELEMETRY_DROPPED = Counter(
    "sandbox_gateway_telemetry_dropped_total",
    "Audit lines the worker did not hand to its OTLP exporter process, by reason: "
    "queue_full (telemetry.queue lines waited), too_large (a line over a datagram), "
    "exporter_down (the exporter process exited; it restarts).",
    ["reason"],
    registry=REGISTRY,
)
TELEMETRY_EXPORT_DROPPED = Counter(
    "sandbox_gateway_telemetry_export_dropped_total",
    "Spans and log records the OTLP exporter process built but did not export, by signal "
    "(traces, logs; lines: an audit line it could not read) and reason: queue_full (the "
    "collector takes them more slowly than they come), unreachable (not taken after the "
    "retries: the collector down, overloaded or timing out), refused (the collector "
    "answered an error that is not retried), unreadable.",
    ["signal", "reason"],
    registry=REGISTRY,
)
AUDIT_DROPPED = Counter(
    "sandbox_gateway_audit_dropped_lines_total",
    "Audit lines dropped: they fitted neither in audit.buffer nor in the spill journal "
    "(audit.spill.max) while the output did not take lines, or at the stop.",
    registry=REGISTRY,
)
AUDIT_WRITE_ERRORS = Counter(
    "sandbox_gateway_audit_write_errors_total",
    "Failed attempts to write audit lines (retried every second), by error (ENOSPC, EPIPE, "
    "EROFS, EIO, ...).",
    ["error"],
    registry=REGISTRY,
)


class Prometheus:
    """The core's telemetry port (core/ports.py `Telemetry`) on these metrics."""

    COUNTS: Mapping[str, Counter] = {
        "tokens_refused": TOKENS_REFUSED, "tokens_issued": TOKENS_ISSUED,
        "destinations_refused": DESTINATIONS_REFUSED, "bytes": BYTES,
        "credentials_injected": CREDENTIALS_INJECTED,
        "exfiltration_blocked": EXFILTRATION_BLOCKED, "model_refusals": MODEL_REFUSALS,
        "dlp_findings": DLP_FINDINGS,
        "budget_refusals": BUDGET_REFUSALS, "metering_refusals": METERING_REFUSALS,
        "reservations_charged": RESERVATIONS_CHARGED, "inference_tokens": INFERENCE_TOKENS,
        "inference_requests": INFERENCE_REQUESTS, "mcp_calls": MCP_CALLS,
        "approvals": APPROVALS, "approval_notifications": APPROVAL_NOTIFICATIONS,
    }
    GAUGES: Mapping[str, Gauge] = {"open_connections": OPEN_CONNECTIONS,
                                   "approvals_pending": APPROVALS_PENDING}
    HISTOGRAMS: Mapping[str, Histogram] = {"decision_seconds": DECISION_SECONDS,
                                           "approval_wait_seconds": APPROVAL_WAIT}

    def count(self, event: str, *labels: str, by: float = 1) -> None:
        child(self.COUNTS[event], *labels).inc(by)

    def gauge(self, name: str, delta: float) -> None:
        self.GAUGES[name].inc(delta)

    def observe(self, name: str, value: float) -> None:
        self.HISTOGRAMS[name].observe(value)


TELEMETRY = Prometheus()
