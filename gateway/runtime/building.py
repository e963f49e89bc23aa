"""Building the gateway's services at start: the runtime directory, ask mode, MCP OAuth,
the revocation relay, the memory guard, the telemetry exporter, the audit spill, the
minted credentials, the upstream proxy, Key Vault's transport, pod identities; and
what the logs must never show."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import certifi

from gateway.core.secret_value import SecretValue
from gateway.engines import patches
from gateway.net.roots import public_roots, verifying_context
from gateway.net.upstream_proxy import UpstreamProxy
from gateway.observability import logs, metrics
from gateway.observability.audit_spill import Spill
from gateway.pipeline.unpacking import UnpackBudgets
from gateway.runtime.memory import MemoryGuard, ceiling_for
from gateway.runtime.parts import GatewayParts
from gateway.runtime.relay_link import RelayLink
from gateway.runtime.startup import StartupError
from gateway.services.approvals import ApprovalService
from gateway.services.approvals.notify import TIMEOUT as NOTIFY_TIMEOUT
from gateway.services.approvals.notify import Webhooks
from gateway.services.mcp_oauth import McpOAuthService
from gateway.services.minting import Credentials, TokenHttp, build_credentials
from gateway.services.secrets import SecretError

if TYPE_CHECKING:
    from gateway.observability.otel_process import ExporterProcess

log = logging.getLogger("sandbox_gateway")

__all__ = ["Building"]


class Building(GatewayParts):
    """The services a gateway builds at start (called from `Gateway.start`)."""

    def _runtime_dir(self) -> Path:
        if self.config.runtime_dir is not None:
            runtime = self.config.runtime_dir
            if self.worker is not None:
                runtime = runtime / f"worker-{self.worker}"
            runtime.mkdir(parents=True, exist_ok=True)
            return runtime
        self._tmp = tempfile.TemporaryDirectory(prefix="sandbox-gateway-")
        return Path(self._tmp.name)

    def _build_approvals(self, overrides: dict[str, tuple[str, int]]) -> ApprovalService:
        """Ask mode, on the state store every process shares; webhooks sent with the
        gateway's own HTTP client (upstream CA, `network.resolve`, the upstream proxy)."""
        cfg = self.config
        http = TokenHttp(upstream_ca=cfg.network.upstream_ca, overrides=overrides,
                         connector=self._connector(), timeout=NOTIFY_TIMEOUT,
                         connect_timeout=cfg.network.timeouts.connect)
        self.approvals = ApprovalService(
            self.state, audit=self.audit_write, telemetry=metrics.TELEMETRY,
            webhooks=Webhooks(cfg.approvals.notify, self.secrets, http, metrics.TELEMETRY),
            retention=cfg.approvals.retention, policies=self.current_policies,
            directory=cfg.policies, proposals=cfg.approvals.proposals)
        return self.approvals

    async def _mcp_oauth_key(self) -> bytes:
        """The key sealing MCP OAuth tokens: the secret store's `mcp_oauth.key_secret`
        (the same on every replica), else `mcp_oauth.key_file` (made at first start)."""
        from gateway.services.mcp_oauth.seal import KEY_FILE, ensure_key, key_from_secret

        cfg = self.config.mcp_oauth
        if cfg.key_secret is not None:
            if cfg.key_file is not None:
                raise StartupError("mcp_oauth: key_secret and key_file both name the key "
                                   "sealing MCP OAuth tokens; keep one")
            try:
                return key_from_secret((await self.secrets.get(cfg.key_secret)).reveal())
            except SecretError as exc:
                raise StartupError(f"mcp_oauth.key_secret: {exc}") from None
            except ValueError as exc:
                raise StartupError(f"mcp_oauth.key_secret {cfg.key_secret!r}: {exc}"
                                   ) from None
        try:
            return ensure_key(cfg.key_file or self.config.certs / KEY_FILE)
        except (OSError, ValueError) as exc:
            raise StartupError(f"mcp_oauth.key_file: {exc}") from None

    def _build_mcp_oauth(self, key: bytes) -> McpOAuthService:
        """The gateway as MCP servers' OAuth client: its requests go through the
        destination guard (`services/mcp_oauth/http.py`), its tokens sealed in the state
        store with `key` (`_mcp_oauth_key`)."""
        from gateway.services.mcp_oauth.http import OAuthHttp
        from gateway.services.mcp_oauth.seal import Sealer

        cfg = self.config
        context = verifying_context(*public_roots(cfg.network.upstream_ca))
        assert self.admin_address is not None
        host, port = self.admin_address
        shown = f"[{host}]" if ":" in host else host
        self.mcp_oauth = McpOAuthService(
            self.state, self._approvals(),
            OAuthHttp(self.guard, context, connector=self._connector(),
                      timeout=cfg.network.timeouts.connect + 10.0),
            Sealer(key), secrets=self.credentials,
            redirect_url=cfg.mcp_oauth.redirect_url or
            f"http://{shown}:{port}/v1/mcp/oauth/callback",
            clients={name: (c.client_id, c.secret) for name, c in cfg.mcp_oauth.clients.items()},
            client_metadata_url=cfg.mcp_oauth.client_metadata_url,
            audit=self.audit_write)
        return self.mcp_oauth

    def _approvals(self) -> ApprovalService:
        assert self.approvals is not None
        return self.approvals

    def _upstream_bundle(self, runtime: Path) -> Path:
        """Public roots plus `network.upstream_ca` (mitmproxy's option replaces the roots)."""
        bundle = Path(certifi.where()).read_bytes()
        extra = self.config.network.upstream_ca
        if extra is not None:
            try:
                bundle += b"\n" + extra.read_bytes()
            except OSError as exc:
                raise StartupError(f"network.upstream_ca: cannot read {extra}: "
                                   f"{exc.strerror}") from None
        path = runtime / "upstream-ca.pem"
        path.write_bytes(bundle)
        return path

    async def _open_relay(self) -> None:
        """A worker: its end of the supervisor's revocation relay, opened before it serves
        (the revocations the store does not have yet come first); then revocations hold
        here as other workers take them. Owed store writes are retried either way."""
        revocations = self.tokens.revocations
        if self.relay_fd is not None:
            try:
                self.relay = await RelayLink.open(self.relay_fd)
            except (OSError, ValueError, TimeoutError) as exc:
                raise StartupError(f"the supervisor's revocation relay: {exc}") from None
            revocations.relay = self.relay
            revocations.adopt(self.relay.snapshot)
            for jti, expires_at in self.relay.early:
                revocations.learn(jti, expires_at)
            self.relay.start(revocations.learn)
        revocations.start()

    def _unpacking(self) -> UnpackBudgets:
        """Each sandbox's unpacking bucket in this process: `limits.unpacked_excess` and
        its rate are the gateway's, split equally between the workers (a sandbox's
        connections spread over them; each worker held the whole before the
        twenty-second session, N times it with N workers)."""
        limits = self.config.limits
        workers = max(1, self.config.workers) if self.worker is not None else 1
        return UnpackBudgets(limits.unpacked_excess // workers,
                             limits.unpacked_excess_rate // workers)

    def _memory_guard(self) -> MemoryGuard:
        """Memory given back after bursts, and the ceiling `limits.memory` (a share of
        the container's limit is split between the workers: runtime/memory.py)."""
        limits = self.config.limits
        workers = max(1, self.config.workers) if self.worker is not None else 1
        ceiling, warning = ceiling_for(limits.memory, limits.memory_percent, workers)
        if warning is not None:
            log.warning("%s", warning)

        def compact() -> None:
            self.gate.connections.compact()
            if self.doors is not None:
                self.doors.compact()

        return MemoryGuard(ceiling, open_connections=lambda: self.gate.open_connections,
                           compact=compact)

    def _otel_exporter(self) -> ExporterProcess | None:
        """The OpenTelemetry exporter process (`telemetry.endpoint`) fed every audit line
        the sink writes, or None: off (gateway/observability/otel_process.py). The SDK is
        imported only in that process, never here."""
        tel = self.config.telemetry
        if tel.endpoint is None:
            return None
        from gateway.observability.otel_feed import OtelFeed
        from gateway.observability.otel_process import ExporterProcess

        def preset_of(credential: str | None) -> str | None:
            found = self.current_policies().credentials.get(credential or "")
            return None if found is None else found.preset

        feed = OtelFeed(traces=tel.traces, logs=self.config.audit.otlp,
                        metrics_on=tel.metrics, sample=tel.sample, queue=tel.queue,
                        preset_of=preset_of)
        exporter = ExporterProcess({
            "endpoint": tel.endpoint, "protocol": tel.protocol, "headers": dict(tel.headers),
            "traces": tel.traces, "logs": self.config.audit.otlp,
            "metrics_on": tel.metrics, "service_name": tel.service_name,
            "queue": tel.queue, "metrics_interval": tel.metrics_interval,
            "worker": self.worker}, feed)
        try:
            exporter.start()
        except OSError as exc:
            raise StartupError(f"telemetry: cannot start the exporter process: {exc}") from None
        exporter.watch()  # (restarts it if it exits)
        tap = self.auditor.tap
        if tap is None:
            self.auditor.tap = feed.tap
        else:
            def both(record: dict[str, Any], now: float, line: bytes) -> None:
                try:
                    tap(record, now, line)
                finally:
                    feed.tap(record, now, line)
            self.auditor.tap = both
        return exporter

    def _audit_spill(self) -> Spill | None:
        """The audit spill journal (`audit.spill`; None with `max: 0`). A worker keeps its
        own segments; a single process takes every worker's a previous run left."""
        spill = self.config.audit.spill
        if not spill.max or spill.path is None:
            return None
        try:
            return Spill(spill.path, spill.max, owner=self.worker or 0,
                         adopt_all=self.worker is None)
        except OSError as exc:
            raise StartupError(
                f"audit.spill.path: cannot use {spill.path}: {exc.strerror or exc} (a "
                "writable directory, on another volume than audit.path; audit.spill.max: 0 "
                "runs without a spill journal)") from None

    @property
    def _log_source(self) -> str:
        return f"gateway-{id(self)}"

    def _log_secrets(self) -> list[SecretValue | str]:
        """Every key and minted value fetched so far, every secret a provider minted for a
        sandbox and its alias, and the claims every token starts with (a token whose
        header was cut off)."""
        values: list[SecretValue | str] = [v for _, v in self.credentials.known_items()]
        for minted in self.state.ephemeral.live():
            values += [minted.value] if minted.alias is None else [minted.value, minted.alias]
        return [*values, logs.token_claims(self.config.tokens.issuer)]

    def _build_credentials(self, overrides: dict[str, tuple[str, int]]) -> Credentials:
        """The gate's secrets port: the secret cache, plus minted credentials (GitHub
        App, Entra ID, AWS, Google, OAuth2) whose token endpoints are reached with the
        public roots + `network.upstream_ca` and `network.resolve`."""
        upstream_ca = self.config.network.upstream_ca
        return build_credentials(self.secrets, self.current_policies,
                                 upstream_ca=upstream_ca, overrides=overrides,
                                 timeout=self.config.network.timeouts.connect + 5.0,
                                 share=self.state, connector=self._connector())

    def _build_proxy(self) -> UpstreamProxy | None:
        """`network.upstream_proxy`: every upstream dial (each engine's, the token
        endpoints', Key Vault's) goes through it, to the address the gateway checked."""
        settings = self.config.network.upstream_proxy
        if settings is None:
            return None
        tls = None
        if settings.scheme == "https":
            tls = verifying_context(*public_roots(self.config.network.upstream_ca))
        log.info("upstream proxy: %s (connect_to: %s%s%s)", settings.where,
                 settings.connect_to, f", no_proxy: {', '.join(settings.no_proxy.entries)}"
                 if settings.no_proxy.entries else "",
                 ", credentials from the environment" if settings.userinfo is not None
                 else f", credentials: secret {settings.credentials}"
                 if settings.credentials else "")
        return UpstreamProxy(settings, secret=lambda name: self.secrets.get(name), tls=tls)

    def _connector(self) -> Callable[..., Any] | None:
        """How the gateway's own HTTP client connects: through the upstream proxy (the
        aiohttp hook is a private one: engines/patches.py), else aiohttp's own way."""
        return None if self.proxy is None else patches.proxied_connector(self.proxy)

    def _vault_transport(self, overrides: dict[str, tuple[str, int]]) -> Any:
        """Key Vault's transport (`secrets.store: azure-keyvault`): the gateway's own
        client (public roots + network.upstream_ca, network.resolve, the upstream proxy,
        never the process's HTTPS_PROXY); None for the other stores."""
        if self.config.secrets.get("store") != "azure-keyvault":
            return None
        proxy = self.proxy
        vault = str(self.config.secrets.get("vault_url") or "")
        host = (urlsplit(vault).hostname or "").lower()
        if proxy is not None and proxy.settings.credentials is not None \
                and proxy.applies(host, None, 443):
            raise StartupError(
                "network.upstream_proxy.credentials: Key Vault is reached through the "
                "upstream proxy, so the proxy's credentials cannot be read from it; list "
                f"{host or 'the vault'} in network.upstream_proxy.no_proxy or use "
                "network.upstream_proxy: env (credentials in the proxy URL)")
        self._vault_http = TokenHttp(upstream_ca=self.config.network.upstream_ca,
                                     overrides=overrides, connector=self._connector(),
                                     timeout=self.config.network.timeouts.connect + 5.0)
        return self._vault_http.azure_transport()

    async def _start_pods(self) -> None:
        """Watch the sandbox namespaces' pods (identity.kubernetes); kubernetes_asyncio
        is imported only then."""
        if not self.config.identity.kubernetes.enabled:
            return
        from gateway.services.identity.kubernetes import PodIdentities

        self.pods = PodIdentities(self.config.identity.kubernetes, self.tokens,
                                  self.current_policies)
        try:
            await self.pods.start()
        except Exception as exc:  # a kubeconfig or service account that cannot be used
            raise StartupError(f"identity.kubernetes: cannot use the Kubernetes API: "
                               f"{type(exc).__name__}: {exc}") from None
