"""Tests say what they cover (issue 41, item 7): every module under gateway/ has its test
file at the mirrored path, or is listed in `COVERED_ELSEWHERE` with the test files that
cover it and how.

The mirrored path of `gateway/<dir>/<name>.py` is `tests/<dir>/test_<name>.py` or
`tests/<dir>/test_<word>_<name>.py`, one word before the name, usually the package's
(`gateway/core/names.py`: `tests/core/test_core_names.py`). A module of a subpackage may
also sit one level up, the subpackage's name as that word (`gateway/engines/h1/pool.py`:
`tests/engines/test_h1_pool.py`). A package's `__init__.py` that defines a function or a
class is a module named after the package (`gateway/cli/__init__.py`: `tests/test_cli.py`,
or in the package's own folder, `tests/cli/test_cli.py`); one that only imports and
re-exports names is none.

A listing names the test files that cover the module and says how. When its reason says
the module is imported ("imports", "imported"), each named file must import it. A module
no test covers is listed with a reason starting "NOT COVERED:" and shows as an expected
failure (`-ra` prints it) until a test covers it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_COVERED = "NOT COVERED:"

# ------------------------------------------------------------------------------- the scan


def _defines_code(init: Path) -> bool:
    return any(isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
               for node in ast.walk(ast.parse(init.read_text())))


def where(module: str) -> tuple[PurePosixPath, str]:
    """A module's folder and name: a package's `__init__.py` is named after the package,
    in the package's parent."""
    path = PurePosixPath(module)
    if path.name == "__init__.py":
        return path.parent.parent, path.parent.name
    return path.parent, path.stem


def modules(root: Path) -> list[str]:
    """The modules under `root`/gateway, as paths from `root` (`gateway/core/names.py`)."""
    found = []
    for path in sorted((root / "gateway").rglob("*.py")):
        module = path.relative_to(root).as_posix()
        if path.name != "__init__.py" or (
                path.parent != root / "gateway" and _defines_code(path)):
            found.append(module)
    return found


def found_tests(root: Path) -> set[PurePosixPath]:
    """The test files under `root`/tests."""
    return {PurePosixPath(p.relative_to(root).as_posix())
            for p in (root / "tests").rglob("test_*.py")}


def mirrors(module: str, tests: set[PurePosixPath]) -> list[str]:
    """The test files among `tests` at `module`'s mirrored path (the docstring's rules)."""
    folder, name = where(module)
    below = PurePosixPath("tests", *folder.parts[1:])
    name_re = re.escape(name)
    places = [(below, rf"test_(?:[a-z0-9]+_)?{name_re}\.py")]
    if len(folder.parts) > 2:  # a subpackage's module, one level up
        places.append((below.parent, rf"test_{re.escape(folder.name)}_{name_re}\.py"))
    if PurePosixPath(module).name == "__init__.py":  # a package, in its own folder
        places.append((below / name, rf"test_(?:[a-z0-9]+_)?{name_re}\.py"))
    return sorted(str(test) for test in tests for place, pattern in places
                  if test.parent == place and re.fullmatch(pattern, test.name))


def unmirrored(root: Path) -> list[str]:
    """The modules with no test file at their mirrored path."""
    tests = found_tests(root)
    return [module for module in modules(root) if not mirrors(module, tests)]


def unlisted(root: Path, listing: dict[str, tuple[str, str]]) -> list[str]:
    """The modules neither mirrored nor listed: each needs a test, or a listing."""
    return [module for module in unmirrored(root) if module not in listing]


def stale(root: Path, listing: dict[str, tuple[str, str]]) -> list[str]:
    """Listed modules that are gone, or that have a mirrored test now."""
    known = set(modules(root))
    tests = found_tests(root)
    return [module for module in listing if module not in known or mirrors(module, tests)]


def dotted(module: str) -> str:
    folder, name = where(module)
    return ".".join((*folder.parts, name))


def imports(source: str, module: str) -> bool:
    """Whether the Python `source` imports `module` itself, in any import statement."""
    name = dotted(module)
    package, _, last = name.rpartition(".")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name == name for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (
                node.module == name
                or (node.module == package and any(a.name == last for a in node.names))):
            return True
    return False


def covering(entry: tuple[str, str]) -> list[str]:
    """The test files a listing names (comma-separated)."""
    return [name.strip() for name in entry[0].split(",") if name.strip()]


def says_imported(reason: str) -> bool:
    return re.search(r"\bimport(s|ed)?\b", reason) is not None


# ---------------------------------------------------------------- the modules listed here

INTEGRATION = "tests/integration"
PARITY = f"{INTEGRATION}/test_parity.py"

COVERED_ELSEWHERE: dict[str, tuple[str, str]] = {
    # --- the command line ---
    "gateway/__main__.py": (
        "tests/cli/test_cli.py, tests/integration/test_startup_output.py, "
        "tests/integration/test_shutdown.py, tests/cli/test_entry_point.py, "
        "tests/reliability/test_memory_burst.py",
        "`python -m gateway` and the `sandbox-gateway` entry point: `--help`, the real "
        "gateway processes these tests start with it, which command lines are `run` (a "
        "table), and `run` started again on jemalloc (the burst test reads its maps)"),
    "gateway/cli/admin_client.py": (
        "tests/services/metering/test_metering_service.py, "
        "tests/integration/test_approvals.py",
        "the CLI's admin API calls: `usage` against a served admin app, `approvals` "
        "against a real gateway"),
    "gateway/cli/mcp_oauth.py": (
        "tests/integration/test_mcp_oauth.py",
        "`mcp-oauth list/--json/revoke` (and `approvals list` showing a consent's URL) run "
        "as processes against a real gateway (test_the_cli_shows_the_consent_url_lists_and_"
        "revokes, both engines)"),
    "gateway/api/mcp_oauth.py": (
        "tests/integration/test_mcp_oauth.py",
        "the callback completed by a browser's redirect (httpx and Chromium), the grants "
        "listed and revoked through the admin API on a real gateway, both engines"),
    "gateway/api/console/mcp_oauth.py": (
        "tests/integration/test_mcp_oauth.py",
        "the MCP OAuth page and its revoke button in Chromium "
        "(test_consent_and_revocation_in_the_console_with_chromium)"),
    "gateway/pipeline/exchange_oauth.py": (
        "tests/pipeline/test_pipeline_oauthing.py, tests/integration/test_mcp_oauth.py",
        "the server's 401 and insufficient_scope read in the answer (a table over the gate "
        "built from fakes), and on both engines"),
    "gateway/services/mcp_oauth/discovery.py": (
        "tests/integration/test_mcp_oauth.py",
        "RFC 9728 and RFC 8414 metadata of the SDK's FastMCP server and authorization "
        "routes; a resource naming another server refused"),
    "gateway/services/mcp_oauth/http.py": (
        "tests/integration/test_mcp_oauth.py",
        "every OAuth request of the tests goes through it (guard, network.resolve, the "
        "upstream CA)"),
    "gateway/services/mcp_oauth/tokens.py": (
        "tests/integration/test_mcp_oauth.py",
        "dynamic registration, PKCE S256 with the resource indicator, code exchange, "
        "refresh and RFC 7009 revocation against the SDK's authorization server"),
    "gateway/cli/approvals.py": (
        "tests/integration/test_approvals.py",
        "`approvals list/--watch/approve/deny/grants/revoke` run as processes against a "
        "real gateway (test_the_cli_lists_answers_watches_and_revokes, the webhook test)"),
    "gateway/cli/ca.py": (
        "tests/cli/test_cli.py", "`ca init` run in-process: the pair made, a half pair"),
    "gateway/cli/common.py": (
        "tests/cli/test_cli.py, tests/integration/test_key_rotation.py",
        "what every command shares (config, credential names, signing keys), through "
        "`token`, `env` and `policy` commands"),
    "gateway/cli/config.py": (
        "tests/tools/test_config_check.py",
        "`config check` run in-process: its exit codes and each warning"),
    "gateway/cli/env.py": (
        "tests/cli/test_cli.py, tests/services/minting/test_minting_cli.py, "
        "tests/integration/test_client_matrix.py, "
        "tests/integration/test_kubernetes_identity.py",
        "`env`, `node-preload` and `jvm-agent` in-process (formats, minting, refusals); "
        "real clients configured only by its output; `env --kubernetes` as a process"),
    "gateway/cli/policy.py": (
        "tests/services/policy/test_policy_testing.py, "
        "tests/services/policy/test_policy_diff.py, tests/services/policy/test_policy_files.py, "
        "tests/cli/test_cli.py",
        "`policy check/explain/test/diff` run in-process beside the logic each calls; "
        "`policy diff` against directories and real git refs, with `--replay`"),
    "gateway/cli/run.py": (
        "tests/integration/test_startup_output.py, tests/integration/test_shutdown.py, "
        "tests/integration/test_worker_processes.py, tests/reliability/test_process.py",
        "`run` as a real process: its banners, SIGTERM drain, `--workers 2`, a second "
        "instance on the same port"),
    "gateway/cli/state.py": (
        "tests/services/state/test_sqlite_tools.py",
        "`state check` / `state backup` on a SQLite file a live process keeps writing"),
    "gateway/cli/token.py": (
        "tests/cli/test_cli.py, tests/integration/test_key_rotation.py, "
        "tests/integration/test_kubernetes_identity.py",
        "`token mint/rotate-key/retire-key` in-process; the running gateway following a "
        "rotation; `token exchange` as a process inside a fake pod"),
    "gateway/cli/usage.py": (
        "tests/services/metering/test_metering_service.py",
        "imported for its table lines, and `usage` run against the served admin app"),
    # --- the admin listener ---
    "gateway/api/admin.py": (
        "tests/api/test_admin_api.py, tests/services/metering/test_metering_report.py",
        "imported: its test under another name, every route over Starlette's TestClient "
        "with a real TokenService and real policies"),
    "gateway/api/explain.py": (
        "tests/api/test_admin_api.py, tests/services/metering/test_metering_report.py",
        "POST /v1/explain through the real app (the decision, resolve with the guard, "
        "bodies and models, bad requests); GET /v1/usage's report, filters and series"),
    "gateway/api/registrations.py": (
        "tests/integration/test_transparent.py, tests/integration/test_worker_state.py",
        "registrations made over the admin API of a real gateway and used by transparent "
        "connections; kept across a restart and seen by every worker"),
    "gateway/api/tokens.py": (
        "tests/api/test_admin_api.py, tests/services/identity/test_issued.py, "
        "tests/integration/test_kubernetes_identity.py",
        "mint, list, revoke and the JWKS through the real app; every issued token "
        "recorded; a pod's token exchanged on a real gateway"),
    "gateway/api/approvals.py": (
        "tests/integration/test_approvals.py, tests/integration/test_console_fuzz.py",
        "the approvals routes on a real gateway: answered through the API and the CLI, "
        "and fuzzed with hostile ids and bodies"),
    "gateway/api/bounds.py": (
        "tests/reliability/test_admin_listener.py",
        "head, body and idle deadlines, the size limit and the connection cap, on a real "
        "gateway's admin listener"),
    "gateway/api/console/advice.py": (
        "tests/api/test_console_requests.py",
        "imported: every refusal code has advice (a table test), shown on a line's page"),
    "gateway/api/console/approvals.py": (
        "tests/api/test_console.py, tests/integration/test_console_browser.py",
        "the inbox and grants pages over TestClient, and answered from a real Chromium"),
    "gateway/api/console/commands.py": (
        "tests/api/test_console_requests.py",
        "the explain command shown for hostile paths: split back by a real bash into the "
        "CLI's exact arguments, nothing run (test_the_explain_command_is_one_quoted_...)"),
    "gateway/api/console/site.py": (
        "tests/api/test_console.py, tests/integration/test_console_fuzz.py",
        "sessions, CSRF and origin checks and the page renderer, through every page"),
    "gateway/api/context.py": (
        "tests/api/test_console_sandboxes.py",
        "imported: the admin listener's context (a dataclass), built by every API test"),
    "gateway/api/errors.py": (
        "tests/api/test_admin_api.py, tests/reliability/test_admin_listener.py",
        "the one error shape, checked in the API's refusals and the listener's own "
        "answers (timeouts, the cap)"),
    "gateway/api/policies.py": (
        "tests/api/test_admin_api.py, tests/api/test_console_sandboxes.py",
        "`GET /v1/policies` and the sandboxes page show it"),
    "gateway/api/probes.py": (
        "tests/reliability/test_admin_listener.py, tests/integration/test_upstream_proxy.py",
        "`/healthz` and `/readyz` answered while the admin listener is full; readiness "
        "checking the upstream proxy"),
    # --- the core ---
    "gateway/core/audit.py": (
        "tests/pipeline/test_pipeline_gate.py, tests/integration/test_enforcement_findings.py",
        "every refusal's one audit line from the gate; the same keys on every decision "
        "and engine"),
    "gateway/core/client.py": (
        "tests/pipeline/test_pipeline_gate.py, tests/pipeline/test_pipeline_asking.py",
        "imported: the client, its tunnel and `Refused`, as the gate's tests build them"),
    "gateway/pipeline/connections.py": (
        "tests/pipeline/test_pipeline_gate.py, tests/reliability/test_process.py",
        "per-sandbox and process-wide connection limits in the gate; running out of "
        "descriptors on a real process"),
    "gateway/pipeline/parts.py": (
        "tests/pipeline/test_pipeline_gate.py, tests/pipeline/test_pipeline_asking.py",
        "the parts the units share, through the gate: health refusals, a policy gone, "
        "destinations pinned once, the fail-closed boundary (the gate's refusal table)"),
    "gateway/pipeline/tunnels.py": (
        "tests/pipeline/test_pipeline_gate.py, tests/integration/test_transparent.py, "
        "tests/integration/test_refusals_inside_tls.py",
        "CONNECT and redirected connections through the gate's refusal table, then on "
        "real gateways (transparent mode in a network namespace, refusals inside TLS)"),
    "gateway/pipeline/requests.py": (
        "tests/pipeline/test_pipeline_gate.py, tests/integration/test_parity.py",
        "every request refusal of the gate's table; every engine's requests in parity"),
    "gateway/pipeline/signing.py": (
        "tests/pipeline/test_pipeline_gate.py, tests/integration/test_minted_aws.py, "
        "tests/core/test_core_minted.py",
        "the swap and a secret that cannot be had in the gate's table; SigV4 re-signing "
        "and provider-minted aliases end to end"),
    "gateway/pipeline/sweep.py": (
        "tests/pipeline/test_pipeline_gate.py, "
        "tests/integration/test_revocation_ends_connections.py",
        "a revoked token's connection ended from fakes, then on every engine"),
    "gateway/pipeline/exchange.py": (
        "tests/pipeline/test_pipeline_gate.py, tests/core/test_core_minted.py, "
        "tests/pipeline/test_pipeline_asking.py",
        "imported: every exchange refusal from fakes; its streaming, MCP and WebSocket "
        "paths run on every engine in tests/integration/test_parity.py"),
    "gateway/cli/policy_learn.py": (
        "tests/cli/test_policy_learn_cli.py, tests/integration/test_learn_end_to_end.py",
        "`policy learn` from an audit file and a real SQLite store, then end to end with "
        "real clients"),
    "gateway/cli/presets.py": (
        "tests/services/policy/test_presets_update.py",
        "`presets update` and `presets list` through the CLI against a local meta API"),
    "gateway/services/policy/learn_io.py": (
        "tests/services/policy/test_policy_learn.py, tests/cli/test_policy_learn_cli.py",
        "the service presets' sets (the first test, directly), the lines read from each "
        "source through the CLI (the second)"),
    "gateway/services/policy/learn_proof.py": (
        "tests/services/policy/test_policy_learn.py, "
        "tests/integration/test_learn_end_to_end.py",
        "the replay proof of a learned policy (the first test, directly), and of one a real "
        "run learned, through the CLI (the second)"),
    "gateway/services/policy/services/update.py": (
        "tests/services/policy/test_presets_update.py",
        "imported: GitHub's meta answer checked and the hosts rewritten in the presets"),
    "gateway/pipeline/exchange_state.py": (
        "tests/pipeline/test_pipeline_gate.py, tests/integration/test_parity.py",
        "what every exchange of the gate's table carries to its one audit line"),
    "gateway/pipeline/exchange_mcp.py": (
        "tests/integration/test_mcp_policy.py, tests/integration/test_parity.py, "
        "tests/pipeline/test_pipeline_gate.py",
        "the SDK's client and a hostile server through both engines; report mode against "
        "evaluate in the gate's tests"),
    "gateway/pipeline/exchange_metering.py": (
        "tests/integration/test_metering.py, tests/integration/test_metering_realtime.py, "
        "tests/pipeline/test_pipeline_asking.py",
        "the SDKs metered and refused, Realtime sessions, a model held for a person"),
    "gateway/pipeline/exchange_response.py": (
        "tests/integration/test_parity.py, tests/integration/test_fail_closed.py",
        "echoes redacted, encodings decoded, upstream failures answered on every engine"),
    "gateway/pipeline/identify.py": (
        "tests/pipeline/test_pipeline_gate.py, tests/integration/test_kubernetes_identity.py",
        "token, registered and pod identities and their per-request recheck, from fakes "
        "and with the fake Kubernetes API"),
    "gateway/core/identity.py": (
        "tests/pipeline/test_pipeline_gate.py, tests/services/identity/test_pod_index.py",
        "imported: the core's view of a verified token, built and checked in both"),
    "gateway/core/local_api.py": (
        "tests/integration/test_refresh.py, tests/pipeline/test_pipeline_gate.py",
        "`POST /v1/tokens/refresh` at sandbox-gateway.internal on a real gateway: lifetime "
        "bound, revocation, the policy opt-in"),
    "gateway/pipeline/markers.py": (
        "tests/services/secrets/test_secrets_ephemeral.py, "
        "tests/services/minting/test_minting_store.py",
        "imported: the leak markers a request is scanned for, rebuilt when minted and "
        "provider-minted secrets change"),
    "gateway/core/ports.py": (
        "tests/pipeline/test_pipeline_gate.py, tests/observability/test_telemetry.py",
        "protocols: the fakes of the gate's tests implement them; the telemetry test "
        "counts on SILENT"),
    "gateway/core/trail.py": (
        "tests/pipeline/test_pipeline_gate.py, tests/pipeline/test_pipeline_asking.py",
        "each refusal rendered and audited once, asserted per code from fakes"),
    # --- the engines ---
    "gateway/engines/dns/__init__.py": (
        "tests/integration/test_dns.py",
        "`start_dns` with `listen.dns` on a real gateway; a bad address stops it"),
    "gateway/engines/dns/limit.py": (
        "tests/engines/test_dns_answer.py, tests/integration/test_dns.py",
        "the rate limiter's unit tests (buckets per sandbox, refill), then a random-label "
        "flood rate-limited on a real gateway"),
    "gateway/engines/dns/server.py": (
        "tests/integration/test_dns.py, tests/integration/test_kubernetes_identity.py",
        "the resolver's UDP and TCP I/O queried by dig and dnspython: answers, refusals, "
        "garbage, an internal error failing closed"),
    "gateway/engines/door.py": (
        f"{PARITY}, tests/reliability/test_timeouts.py",
        "both doors' accept, deadline and hand-offs: every parity row starts here; the "
        "handshake timeout"),
    "gateway/engines/frontdoor.py": (
        f"{PARITY}, tests/integration/test_egress_safety.py",
        "the proxy port's CONNECT and plain requests up to their engine: every parity row "
        "on the h1 engine runs through it"),
    "gateway/engines/h1/server.py": (
        f"{PARITY}, tests/integration/test_intercept_path.py, "
        "tests/integration/test_credentials.py",
        "the HTTP/1 engine: every parity row runs through it on a real gateway"),
    "gateway/engines/h1/side.py": (
        "tests/integration/test_intercept_path.py, tests/reliability/test_timeouts.py",
        "each side's transport, TLS and buffer under the HTTP/1 engine: every intercepted "
        "request; phase timeouts"),
    "gateway/engines/h1/websocket.py": (
        "tests/integration/test_egress_safety.py, tests/integration/test_metering_realtime.py",
        "WebSocket messages checked both ways on a real gateway (leaks, the relay, no "
        "retention); Realtime sessions metered"),
    "gateway/engines/mitm.py": (
        f"{PARITY}, tests/integration/test_fail_closed.py",
        "the mitmproxy engine: every parity row runs through it "
        "(`network.intercept: mitmproxy`, and HTTP/2); its fail-closed boundary"),
    "gateway/engines/patches.py": (
        "tests/engines/test_h1_framing.py, tests/engines/test_head_reader.py, "
        "tests/engines/test_patches_pins.py, tests/engines/test_first_bytes.py",
        "imported: h11's readers (framing, differential tests against h11), the version "
        "pins, the ClientHello reading (a differential test against mitmproxy's); "
        "mitmproxy's hooks run on every engine"),
    "gateway/engines/splice.py": (
        "tests/integration/test_egress_safety.py, tests/reliability/test_passthrough_lifecycle.py",
        "passthrough and `protocol: tcp` tunnels relayed and ended (half-close, revocation, "
        "lifetimes) on a real gateway"),
    "gateway/engines/transparent.py": (
        "tests/integration/test_transparent.py, tests/integration/test_parity_transparent.py",
        "the transparent door under iptables REDIRECT in network namespaces (`-m netns`, "
        "root)"),
    # --- network, observability ---
    "gateway/net/upstream_proxy.py": (
        "tests/net/test_proxy_handshake.py, tests/integration/test_upstream_proxy.py",
        "imported: `UpstreamProxy.open` against a fake proxy peer; every path through a "
        "real squid and dante"),
    "gateway/observability/audit.py": (
        "tests/observability/test_audit_sink.py, tests/observability/test_audit_spill.py",
        "imported: the audit sink against real files, a full tmpfs, pipes, /dev/full"),
    "gateway/observability/audit_out.py": (
        "tests/observability/test_audit_sink.py, tests/observability/test_audit_spill.py",
        "imported: the sink's outputs (file, stdout, a descriptor) under real failures"),
    "gateway/observability/metrics.py": (
        "tests/observability/test_telemetry.py, tests/services/metering/test_metering_service.py",
        "imported: every event the code counts has a Prometheus metric; totals read back"),
    # --- wiring and processes ---
    "gateway/runtime/app.py": (
        "tests/integration/test_proxy_basics.py, tests/integration/test_worker_processes.py",
        "the gateway's wiring: every integration test runs a real `Gateway` "
        "(tests/helpers/gateway.py) or a real `run` process"),
    "gateway/runtime/building.py": (
        "tests/integration/test_proxy_basics.py, tests/integration/test_worker_processes.py, "
        "tests/integration/test_otel_export.py, tests/integration/test_mcp_oauth.py",
        "the services every real `Gateway` builds at start (the tests' GatewayThread and "
        "`run` processes): the revocation relay, the exporter process, MCP OAuth's key"),
    "gateway/runtime/lifecycle.py": (
        "tests/integration/test_shutdown.py, tests/reliability/test_lifecycle.py, "
        "tests/reliability/test_state_outage.py",
        "readiness, the drain and the stop of real gateway processes: /readyz through "
        "degraded and refusing stores, SIGTERM with requests in flight"),
    "gateway/runtime/listening.py": (
        "tests/integration/test_dns.py, tests/integration/test_parity.py",
        "the DNS resolver started on `listen.dns`, and mitmproxy's master taking the "
        "doors' ports (every parity row runs on the mitmproxy engine too)"),
    "gateway/runtime/parts.py": (
        "tests/integration/test_proxy_basics.py",
        "attribute declarations and the policy lookups of every real `Gateway`"),
    "gateway/runtime/sweeper.py": (
        "tests/integration/test_revocation_ends_connections.py",
        "a revoked token's open connections end within a second, on every engine"),
    "gateway/runtime/memory.py": (
        "tests/runtime/test_memory_guard.py, tests/reliability/test_memory_burst.py",
        "the memory guard's release rules (its own table test), and a real gateway's RSS "
        "after 5,000 closed tunnels and its memory ceiling's refusals"),
    "gateway/runtime/relay_link.py": (
        "tests/runtime/test_relay.py",
        "the worker's end of the revocation relay: the relay's tests import it and run "
        "both ends over real socketpairs"),
    "gateway/services/identity/claims.py": (
        "tests/services/identity/test_tokens.py",
        "scope parsing and formatting, cidr and user bindings, refused claims and the "
        "unverified read, table-driven beside the tokens they are part of"),
    "gateway/services/identity/signing_keys.py": (
        "tests/services/identity/test_tokens.py",
        "loading, refusing a key that is not Ed25519, rotating and retiring the signing "
        "keys with the tokens they sign, a watcher following the directory"),
    "gateway/services/mcp_oauth/flows.py": (
        "tests/services/mcp_oauth/test_service_mcp_oauth.py, "
        "tests/integration/test_mcp_oauth.py",
        "a consent opened and completed between a held request's two reads (its grant "
        "written before its approval closed); consents completed in a browser, declined, "
        "timed out and shared by held requests on real gateways"),
    "gateway/services/state/health.py": (
        "tests/services/state/test_state.py, tests/reliability/test_state_outage.py",
        "state.unavailable read and validated (the config table), and the degraded "
        "readiness and refuse mode of real `run --workers 2` processes on a full disk "
        "and a killed redis-server"),
    # --- services: approvals, identity ---
    "gateway/services/approvals/__init__.py": (
        "tests/services/approvals/test_service.py, tests/api/test_console.py",
        "imported: `ApprovalService` on real stores (two on one SQLite file), and behind "
        "the console"),
    "gateway/services/identity/keywatch.py": (
        "tests/services/identity/test_tokens.py, tests/integration/test_key_rotation.py",
        "key fingerprints and the watcher in the token tests; a running gateway follows "
        "rotation"),
    "gateway/services/identity/kubernetes/__init__.py": (
        "tests/integration/test_kubernetes_identity.py, tests/integration/test_parity_pods.py",
        "pod identities against the fake Kubernetes API: labels, deletion, stale watch, "
        "the token exchange"),
    "gateway/services/identity/kubernetes/accounts.py": (
        "tests/integration/test_kubernetes_identity.py",
        "the token exchange's TokenReview and OIDC verifiers against the fake API: good, "
        "another audience, expired, pod gone"),
    "gateway/services/identity/kubernetes/pods.py": (
        "tests/services/identity/test_pod_index.py",
        "imported: its test under another name, the pod index table-driven"),
    "gateway/services/identity/kubernetes/watch.py": (
        "tests/integration/test_kubernetes_identity.py, tests/integration/test_parity_pods.py",
        "list and watch against the fake API: a cut or compacted watch followed, a stale "
        "one failing closed"),
    # --- services: metering ---
    "gateway/core/ephemeral.py": (
        "tests/services/secrets/test_secrets_ephemeral.py, tests/core/test_core_minted.py",
        "a value type: kept, looked up by alias and expired through EphemeralKeys"),
    "gateway/core/metering/endpoints.py": (
        "tests/core/test_metering_usage.py, "
        "tests/core/test_metering_models.py, "
        "tests/core/test_metering_estimate.py",
        "imported: which API a request calls, its model, the include_usage rewrite"),
    "gateway/services/metering/exchange.py": (
        "tests/services/metering/test_metering_fail_closed.py, "
        "tests/services/metering/test_metering_service.py",
        "value types the step hands out: every admitted `Exchange` and the audit record "
        "`Metered.as_record` gives are asserted in these tables"),
    "gateway/services/metering/refusing.py": (
        "tests/services/metering/test_metering_fail_closed.py, "
        "tests/pipeline/test_pipeline_gate.py",
        "every `metering_unavailable` and `minted_secret_refused` row of the step's refusal "
        "table, with its reason; the codes counted in the gateway's metrics"),
    "gateway/services/metering/ledger.py": (
        "tests/services/metering/test_metering_report.py",
        "imported: the hourly and daily buckets against the rows the same data gives"),
    "gateway/core/metering/pricing.py": (
        "tests/core/test_metering_catalogue.py, "
        "tests/services/metering/test_metering_budgets.py",
        "imported: prices and limits over the catalogue, and budgets priced by them"),
    "gateway/services/metering/pricing.py": (
        "tests/services/metering/test_metering_budgets.py",
        "imported: the operator's pricing file read (load_pricing), errors named"),
    "gateway/services/metering/catalogue.py": (
        "tests/core/test_metering_catalogue.py",
        "imported: the vendored file read once, the models the bounds rest on"),
    "gateway/core/metering/scan.py": (
        "tests/core/test_metering_usage.py",
        "imported: the SSE scanner over real-shaped responses split at every byte"),
    # --- services: minting ---
    "gateway/services/minting/__init__.py": (
        "tests/services/minting/test_minting_store.py, tests/integration/test_minted_oauth.py",
        "the package's names used by the store's tests; `build_credentials` wires every "
        "minted credential of a real gateway"),
    "gateway/services/minting/aio.py": (
        "tests/services/minting/test_minting_http.py, tests/services/approvals/test_notify.py",
        "the aiohttp session of the token endpoint client and the webhooks, on local "
        "servers"),
    "gateway/services/minting/aws.py": (
        "tests/services/minting/test_minting_sigv4.py, tests/integration/test_minted_aws.py",
        "`key_set` beside the re-signer; the real boto3 Bedrock client through a real "
        "gateway, STS refusals"),
    "gateway/services/minting/azure.py": (
        "tests/integration/test_minted_azure.py",
        "Entra ID tokens minted with azure-identity against a local fake, used by the "
        "official AzureOpenAI client"),
    "gateway/services/minting/base.py": (
        "tests/integration/test_minted_github.py, tests/integration/test_minted_oauth.py, "
        "tests/integration/test_minted_aws.py",
        "the minter contract (a protocol) and `read_secret`/`clean`, which every minter "
        "calls: GitHub, Google, OAuth2 and AWS credentials minted by real gateways"),
    "gateway/services/minting/check.py": (
        "tests/services/minting/test_minting_cli.py",
        "`policy check --secrets` reads every secret a credential names and checks its "
        "shape"),
    "gateway/services/minting/errors.py": (
        "tests/services/minting/test_minting_http.py, "
        "tests/services/minting/test_minting_shared.py",
        "one exception class, no logic: raised by the token endpoint client and the "
        "minters, caught in these tests"),
    "gateway/services/minting/github.py": (
        "tests/integration/test_minted_github.py",
        "GitHub App tokens for a real git clone and push against a fake GitHub that "
        "checks the App JWT"),
    "gateway/services/minting/google.py": (
        "tests/integration/test_minted_oauth.py",
        "google-auth service-account tokens against a fake endpoint checking the RS256 "
        "assertion"),
    "gateway/services/minting/oauth2.py": (
        "tests/integration/test_minted_oauth.py",
        "client-credentials and refresh-token grants: one mint for 100 requests, refresh "
        "ahead, rotation, a failed mint"),
    # --- services: policy ---
    "gateway/core/policy/ask_rule.py": (
        "tests/services/policy/test_policy_ask.py, tests/pipeline/test_pipeline_asking.py",
        "imported: `ask:` as loaded, and what the gate asks with it"),
    "gateway/services/policy/build.py": (
        "tests/services/policy/test_policy_loader.py, "
        "tests/services/metering/test_metering_policy.py",
        "every loaded policy set is built by it from what the readers return: extends, "
        "credentials a rule names, inherited budgets, with file:line errors"),
    "gateway/core/policy/compiled.py": (
        "tests/core/test_policy_matcher.py, tests/services/policy/test_policy_loader.py",
        "`compile_policy` and `decide`, behind every decision these tables assert"),
    "gateway/core/policy/injection.py": (
        "tests/core/test_core_credentials.py, tests/services/minting/test_minting_policy.py",
        "a value type: each carrier's injection and alternatives, and minted types' "
        "carriers"),
    "gateway/core/policy/minted.py": (
        "tests/services/minting/test_minting_policy.py, "
        "tests/services/minting/test_minting_store.py",
        "imported: every minted type's fields, defaults, hosts and carriers"),
    "gateway/core/policy/model.py": (
        "tests/services/metering/test_metering_policy.py, "
        "tests/core/test_metering_models.py",
        "imported: the frozen rule, credential and decision values the matcher and "
        "loader tests build"),
    "gateway/core/policy/presets.py": (
        "tests/services/policy/test_policy_loader.py, tests/integration/test_credentials.py",
        "pure data: every preset loads as a credential, carriers checked (test_presets); "
        "the official openai and anthropic SDKs use theirs through a real gateway"),
    "gateway/services/policy/problems.py": (
        "tests/services/policy/test_policy_nodes.py, tests/services/policy/test_policy_loader.py, "
        "tests/services/policy/test_policy_files.py",
        "the shared collector saying every problem at once (test_policy_nodes); every "
        "`file:line: message` the loader's tables expect, and files never echoed"),
    "gateway/services/policy/raw.py": (
        "tests/services/policy/test_read_rules.py, tests/services/policy/test_read_budgets.py, "
        "tests/services/policy/test_read_credentials.py, tests/services/policy/test_read_policy.py",
        "imported: what the section readers return (model objects with their positions), "
        "asserted in each reader's table"),
    "gateway/services/policy/replay.py": (
        "tests/services/policy/test_policy_diff.py, tests/integration/test_policy_replay.py",
        "replay's grouping and speed in the diff tests; audit lines recorded from a real "
        "gateway replayed"),
    "gateway/services/policy/report.py": (
        "tests/services/policy/test_policy_diff.py",
        "imported: the diff's text, JSON and markdown rendering; `policy test` output "
        "through the CLI"),
    # --- services: secrets, state ---
    "gateway/services/secrets/base.py": (
        "tests/services/secrets/test_secrets_stores.py, tests/observability/test_logs.py",
        "the store contract's errors: their messages name the secret and the store, "
        "never a value"),
    "gateway/services/secrets/env.py": (
        "tests/services/secrets/test_secrets_stores.py",
        "`EnvStore` and `env_var_name`, table tests beside the file store"),
    "gateway/services/secrets/factory.py": (
        "tests/services/secrets/test_secrets_stores.py, tests/test_chart.py",
        "stores and the cache built from `secrets:` (file, env, the cache's durations); "
        "the chart's rendered configs built into stores"),
    "gateway/services/secrets/file.py": (
        "tests/services/secrets/test_secrets_stores.py",
        "`FileStore`: permissions, reload on inode/size/mtime change, on real files"),
    "gateway/services/state/base.py": (
        "tests/services/state/test_state_contract.py, tests/services/state/test_state.py",
        "imported: the `StateStore` contract run against every store"),
    "gateway/services/state/counters_redis.py": (
        "tests/services/state/test_counters.py, tests/services/state/test_state_leases.py",
        "counters batched to a real redis-server by the RedisState these tests open"),
    "gateway/services/state/counters_redis_write.py": (
        "tests/services/state/test_counters.py",
        "every Redis counter write goes through it: a write whose answer never came "
        "(redis-server stopped or its clients paused) counts once, on a real redis-server"),
    "gateway/services/state/factory.py": (
        "tests/services/state/test_state.py",
        "imported: the store `state:` names, and its errors"),
    "gateway/services/state/lease_keeper.py": (
        "tests/services/state/test_state_leases.py",
        "imported: a process's lease and heartbeat on every store"),
    "gateway/services/state/log.py": (
        "tests/services/state/test_state_contract.py, tests/api/test_console_requests.py",
        "the request log's queries on every store, and filtered, paged and streamed as "
        "the console reads it"),
    "gateway/services/state/log_feed.py": (
        "tests/api/test_console_requests.py, tests/integration/test_console_log_workers.py",
        "the console's feed from the audit sink (batches, the hold); every worker's lines "
        "in one log on real processes"),
    "gateway/services/state/redis_link.py": (
        "tests/services/state/test_state_redis.py, tests/reliability/test_state_outage.py",
        "RedisState's link on a real redis-server: the start that waits for Redis and the one "
        "that gives up, events followed, a restart re-synced, calls bounded and refused "
        "while it is away; Redis killed under a running gateway"),
    "gateway/services/state/redis_log.py": (
        "tests/services/state/test_state_contract.py",
        "the store contract's request-log cases (append, filters, cursors, the bound) run "
        "on a real redis-server"),
    "gateway/services/state/redis_mints.py": (
        "tests/services/state/test_state_contract.py",
        "the store contract's mint share and refresh-token cases on a real redis-server (one "
        "lease holder at a time, released only by its holder, a rotated token kept)"),
    "gateway/services/state/redis_records.py": (
        "tests/services/state/test_state_contract.py, tests/services/approvals/test_pins.py",
        "the store contract's shared-record cases (versions, expiry, the change counter "
        "and its wake-up) on a real redis-server; tool pins shared through it"),
    "gateway/services/state/sqlite_mints.py": (
        "tests/services/state/test_state_contract.py, "
        "tests/integration/test_worker_minting.py",
        "the store contract's mint share and refresh-token cases, run on a real SqliteState "
        "file (one lease holder at a time, a rotated token kept); credentials minted once "
        "for the worker processes of a real gateway sharing the file"),
    "gateway/services/state/sqlite_records.py": (
        "tests/services/state/test_state_contract.py, tests/services/approvals/test_service.py",
        "the store contract's shared-record cases (versions, expiry, the change counter) "
        "on a real SqliteState file; ask mode's approvals and grants over it"),
    "gateway/services/state/memory_counters.py": (
        "tests/services/state/test_counters.py, tests/services/state/test_state_leases.py",
        "imported: the one-process counters and leases, beside the shared ones"),
    # --- tools ---
    "gateway/tools/explain.py": (
        "tests/core/test_core_evaluate.py, tests/core/test_policy_matcher.py",
        "imported: `explain` gives the proxy's verdict for every parity case; the CLI and "
        "the API answer through it"),
}

# -------------------------------------------------------------------------------- checks


def test_every_module_is_mirrored_or_listed() -> None:
    missing = unlisted(ROOT, COVERED_ELSEWHERE)
    assert missing == [], (
        "modules with no test at their mirrored path and no listing: write "
        "tests/<dir>/test_<name>.py, or list the module in COVERED_ELSEWHERE "
        f"(tests/test_mirror.py) with the tests that cover it and how: {missing}")


def test_every_listing_is_of_a_module_without_its_mirrored_test() -> None:
    assert stale(ROOT, COVERED_ELSEWHERE) == [], (
        "listed modules that are gone or now have a test at their mirrored path: remove "
        "their listing from COVERED_ELSEWHERE")


@pytest.mark.parametrize("module", sorted(COVERED_ELSEWHERE))
def test_each_listing_names_tests_that_exist(module: str) -> None:
    entry = COVERED_ELSEWHERE[module]
    reason = entry[1]
    assert reason.strip(), f"{module}: say how the tests cover it"
    if reason.startswith(NOT_COVERED):
        pytest.xfail(f"{module}: {reason}")
    named = covering(entry)
    assert named, f"{module}: name the tests that cover it"
    for name in named:
        path = ROOT / name
        assert name.startswith("tests/") and path.is_file(), f"{module}: no {name}"
        if says_imported(reason):
            assert imports(path.read_text(), module), (
                f"{module}: the reason says it is imported, {name} does not import it")


# ------------------------------------------------------------------ the check, on a tree


def _tree(root: Path, files: list[str]) -> Path:
    for name in files:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    return root


def test_a_new_module_without_a_test_or_a_listing_fails_the_check(tmp_path: Path) -> None:
    """The mutation the check exists for, on a copy of the real layout (file names only):
    one new module under gateway/ is reported, and only it."""
    copy = _tree(tmp_path, [m for m in modules(ROOT) if not m.endswith("__init__.py")]
                 + [str(t) for t in found_tests(ROOT)])
    for init in (ROOT / "gateway").rglob("__init__.py"):  # (read: does it define code?)
        _tree(copy, [init.relative_to(ROOT).as_posix()])
        (copy / init.relative_to(ROOT)).write_text(init.read_text())
    assert unlisted(copy, COVERED_ELSEWHERE) == []
    _tree(copy, ["gateway/services/metering/forecast.py"])
    assert unlisted(copy, COVERED_ELSEWHERE) == ["gateway/services/metering/forecast.py"]
    _tree(copy, ["tests/services/metering/test_metering_forecast.py"])
    assert unlisted(copy, COVERED_ELSEWHERE) == []


def test_a_mirrored_test_makes_a_listing_stale(tmp_path: Path) -> None:
    tree = _tree(tmp_path, ["gateway/core/clock.py", "tests/core/test_time.py"])
    listing = {"gateway/core/clock.py": ("tests/core/test_time.py", "reads the clock")}
    assert unlisted(tree, listing) == [] and stale(tree, listing) == []
    _tree(tree, ["tests/core/test_core_clock.py"])
    assert stale(tree, listing) == ["gateway/core/clock.py"]
    (tree / "gateway/core/clock.py").unlink()
    assert stale(tree, listing) == ["gateway/core/clock.py"]  # gone: stale too


MIRRORED = [
    ("gateway/core/names.py", "tests/core/test_names.py", True),
    ("gateway/core/names.py", "tests/core/test_core_names.py", True),
    ("gateway/core/names.py", "tests/core/test_core_host_names.py", False),  # one word
    ("gateway/core/names.py", "tests/test_core_names.py", False),  # another folder
    ("gateway/core/names.py", "tests/core/test_core_names_more.py", False),
    ("gateway/core/names.py", "tests/core/core_names.py", False),
    ("gateway/lazy.py", "tests/test_lazy.py", True),
    ("gateway/core/metering/estimate.py",
     "tests/core/metering/test_metering_estimate.py", True),
    ("gateway/core/metering/estimate.py", "tests/core/test_metering_estimate.py",
     True),  # a subpackage's module, one level up, named with the subpackage
    ("gateway/core/metering/estimate.py", "tests/core/test_estimate.py", False),
    ("gateway/core/metering/estimate.py", "tests/core/test_billing_estimate.py",
     False),
    ("gateway/engines/h1/pool.py", "tests/engines/test_h1_pool.py", True),
    ("gateway/engines/door.py", "tests/test_engines_door.py", False),  # not from gateway/
    ("gateway/cli/__init__.py", "tests/test_cli.py", True),
    ("gateway/cli/__init__.py", "tests/cli/test_cli.py", True),
    ("gateway/cli/__init__.py", "tests/cli/test_init.py", False),
    ("gateway/services/approvals/__init__.py", "tests/services/test_approvals.py", True),
    ("gateway/services/approvals/__init__.py",
     "tests/services/approvals/test_service.py", False),
]


@pytest.mark.parametrize(("module", "test", "mirrored"), MIRRORED)
def test_the_mirrored_path(module: str, test: str, mirrored: bool) -> None:
    assert bool(mirrors(module, {PurePosixPath(test)})) is mirrored


def test_a_package_counts_as_a_module_only_with_code(tmp_path: Path) -> None:
    tree = _tree(tmp_path, ["gateway/__init__.py", "gateway/a/__init__.py",
                            "gateway/b/__init__.py", "gateway/c/__init__.py"])
    (tree / "gateway/__init__.py").write_text("def version() -> str:\n    return '1'\n")
    (tree / "gateway/a/__init__.py").write_text('"""A facade."""\nfrom x import y as y\n')
    (tree / "gateway/b/__init__.py").write_text("class B:\n    pass\n")
    (tree / "gateway/c/__init__.py").write_text("async def start() -> None:\n    pass\n")
    assert modules(tree) == ["gateway/b/__init__.py", "gateway/c/__init__.py"]


IMPORTS = [
    ("import gateway.core.names", True),
    ("import gateway.core.names as n", True),
    ("from gateway.core.names import normalize_host", True),
    ("from gateway.core import names", True),
    ("def f():\n    from gateway.core.names import is_ip", True),  # wherever it is
    ("from gateway.core import target", False),
    ("from gateway.core.names_extra import x", False),
    ("import gateway.core", False),
    ("from .names import x", False),
    ("# from gateway.core.names import x", False),
]


@pytest.mark.parametrize(("source", "imported"), IMPORTS)
def test_which_sources_import_a_module(source: str, imported: bool) -> None:
    assert imports(source, "gateway/core/names.py") is imported


def test_a_package_is_imported_by_its_dotted_name() -> None:
    module = "gateway/services/approvals/__init__.py"
    assert imports("from gateway.services.approvals import ApprovalService", module)
    assert imports("from gateway.services import approvals", module)
    assert not imports("from gateway.services.approvals.notify import x", module)


def test_a_reason_that_says_imported_is_checked() -> None:
    assert says_imported("imported: the table tests")
    assert says_imported("it imports the module")
    assert not says_imported("the real gateway; see test_optional_imports.py")
    assert not says_imported("importance")
