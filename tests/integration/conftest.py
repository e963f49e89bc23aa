"""Fixtures: a local TLS upstream under several names, a real gateway in front of it, and
a headless Chromium (`browser`; tests/helpers/browser.py) whose screenshot and page are
saved when its test fails.

Names reach the upstream only through the gateway's `network.resolve` (operator-
trusted overrides to 127.0.0.1): nothing here resolves or dials anything off-box.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from fakes.inference import FakeInference
from helpers.gateway import BASE_POLICY, GatewayFactory, GatewayThread
from helpers.tls import LocalCA
from helpers.upstream import Upstream, start_upstream

NAMES = ["allowed.test", "api.allowed.test", "other.test", "report.test", "pypi.org",
         "api.openai.com", "api.anthropic.com", "api.github.com", "unbound.test",
         "minted.test", "mintfail.test", "budget.test", "metered.test", "sigv4.test"]
if TYPE_CHECKING:
    from helpers.browser import WebDriver

REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


@pytest.fixture
def fake(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FakeInference]:
    """A fake OpenAI-shaped provider that takes its test module's `KEY` (the key the
    module checks never leaks). A module that needs other options defines its own."""
    with FakeInference(tmp_path / "fake", api_key=request.module.KEY) as server:
        yield server


@pytest.fixture(scope="session")
def test_ca(tmp_path_factory: pytest.TempPathFactory) -> LocalCA:
    return LocalCA.create(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="session")
def upstream(test_ca: LocalCA, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstream]:
    ctx = test_ca.server_context(tmp_path_factory.mktemp("leaf"), NAMES)
    server = start_upstream(ctx)
    yield server
    server.close()


def _factory(workdir: Path, test_ca: LocalCA, upstream: Upstream,
             started: list[GatewayThread]) -> GatewayFactory:
    def factory(policies: dict[str, str] | None = None, config: dict[str, Any] | None = None,
                **kw: Any) -> GatewayThread:
        pdir = workdir / "policies"
        pdir.mkdir(exist_ok=True)
        for name, text in (policies or {"agent.yaml": BASE_POLICY}).items():
            (pdir / name).write_text(text)
        cfg: dict[str, Any] = {
            "network": {"upstream_ca": str(test_ca.cert_path),
                        "resolve": {n: f"127.0.0.1:{upstream.port}" for n in NAMES}},
            "secrets": {"store": "env"},
        }
        for key, value in (config or {}).items():
            if isinstance(value, dict) and isinstance(cfg.get(key), dict):
                cfg[key] = {**cfg[key], **value}
            else:
                cfg[key] = value
        gw = GatewayThread(workdir, cfg, **kw)
        started.append(gw)
        return gw
    return factory


@pytest.fixture
def make_gateway(tmp_path: Path, test_ca: LocalCA, upstream: Upstream
                 ) -> Iterator[GatewayFactory]:
    started: list[GatewayThread] = []
    yield _factory(tmp_path, test_ca, upstream, started)
    for gw in started:
        gw.stop()


@pytest.fixture(scope="module")
def make_module_gateway(tmp_path_factory: pytest.TempPathFactory, test_ca: LocalCA,
                        upstream: Upstream) -> Iterator[GatewayFactory]:
    """`make_gateway` for a gateway the module's tests share (each its own sandbox and
    token, and the audit lines after its start): stopped after the module's last test."""
    started: list[GatewayThread] = []
    yield _factory(tmp_path_factory.mktemp("module-gw"), test_ca, upstream, started)
    for gw in started:
        gw.stop()


@pytest.fixture
def gateway(make_gateway: GatewayFactory) -> GatewayThread:
    return make_gateway()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Iterator[pytest.TestReport]:
    """Each phase's report kept on the item, for fixtures' teardown (`browser`)."""
    report: pytest.TestReport = yield
    item.stash.setdefault(REPORTS, {})[report.when] = report
    return report


@pytest.fixture
def browser(request: pytest.FixtureRequest) -> Iterator[WebDriver]:
    """A headless Chromium (fresh profile) for one test; when the test fails, a
    screenshot and the page's HTML are saved (helpers.browser.artifacts_dir()) and named
    in the failure's report. Every Chromium process is checked gone afterwards."""
    from helpers.browser import save_artifacts, start_browser, stop_browser

    driver = start_browser()
    try:
        yield driver
    finally:
        try:
            failed = [r for r in request.node.stash.get(REPORTS, {}).values() if r.failed]
            if failed:
                saved = save_artifacts(driver, request.node.nodeid)
                for report in failed:
                    report.sections.append(("browser artifacts",
                                            "\n".join(str(p) for p in saved)))
        finally:
            stop_browser(driver)
