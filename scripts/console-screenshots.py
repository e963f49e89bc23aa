"""Screenshots of the console for docs/console.md, from a real gateway (two workers, the
local fake OpenAI) and real traffic, in headless Chromium (the browser tests' harness).

    .venv/bin/python scripts/console-screenshots.py   # writes docs/console-*.png
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fakes.inference import FakeInference  # noqa: E402
from helpers.browser import open_page, sign_in, start_browser, stop_browser  # noqa: E402
from helpers.clients import open_tunnel  # noqa: E402
from helpers.process import ADMIN, start_with_provider  # noqa: E402
from helpers.tls import LocalCA  # noqa: E402

KEY = "sk-fake-provider-key-screenshots"
POLICY = """
version: v1
name: agent
egress:
  - host: api.openai.com
    credential: openai
    models: [gpt-4o-mini]
  - host: pypi.org
    action: deny
    reason: packages come from the internal mirror
budgets:
  - {name: daily, per: sandbox, window: 24h, tokens: 500000}
credentials:
  openai: {preset: openai, secret: provider-key}
"""


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="sgw-shots-"))
    ca = LocalCA.create(work / "ca")
    with FakeInference(work / "fake", api_key=KEY) as fake:
        gw = start_with_provider(work / "gw", fake, ca, key=KEY, policy=POLICY)
        try:
            traffic(gw)
            time.sleep(0.6)  # (the request log is written every 0.25 s)
            driver = start_browser()
            try:
                admin = f"http://127.0.0.1:{gw.admin}"
                sign_in(driver, admin, ADMIN)
                for name, path in (("requests", "/console/requests?view=refused"),
                                   ("usage", "/console/usage?sandbox=sbx-reviewer")):
                    open_page(driver, admin + path)
                    time.sleep(0.5)
                    driver.save_screenshot(str(ROOT / "docs" / f"console-{name}.png"))
            finally:
                stop_browser(driver)
        finally:
            gw.stop()


def traffic(gw: object) -> None:
    """A few sandboxes' calls: allowed chats, a model and a host refused."""
    from helpers.process import GatewayProcess

    assert isinstance(gw, GatewayProcess)
    verify = str(gw.workdir / "certs" / "ca.crt")
    for sandbox, models in (("sbx-reviewer", ["gpt-4o-mini"] * 3 + ["gpt-4o"]),
                            ("sbx-builder", ["gpt-4o-mini"] * 2)):
        token = gw.token(sandbox)
        with httpx.Client(proxy=f"http://{sandbox}:{token}@127.0.0.1:{gw.proxy}",
                          verify=verify, timeout=20) as http:
            for model in models:
                http.post("https://api.openai.com/v1/chat/completions",
                          json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
                          headers={"Authorization": f"Bearer {token}"})
        for host in ("pypi.org", "exfil.example"):
            with contextlib.suppress(ConnectionRefusedError):  # (refused: what is shown)
                open_tunnel(("127.0.0.1", gw.proxy), f"{host}:443", token, sandbox, timeout=5)


if __name__ == "__main__":
    main()
