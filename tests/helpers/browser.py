"""The console in a real headless Chromium: Debian's `chromium`, driven by Selenium
through Debian's `chromedriver` (both from PATH; `scripts/test-tools.sh` installs them;
a missing one fails the test, it is not skipped).

`start_browser` / `stop_browser` own the processes (a fresh profile each, every Chromium
process checked gone at the end); the fixture `browser` (tests/integration/conftest.py)
uses them and saves a screenshot and the page's HTML under `artifacts_dir()` when a test
fails. Waits are explicit (`wait_for`, `wait_for_text`), never implicit.

Console helpers, so a page's browser test is a few lines:
- `sign_in(driver, admin_url, token)`: types the admin token into the sign-in form;
- `open_page(driver, url)`, `page_html(driver)`: a page's HTML, remembered for
  `pages_seen(driver)` (what `assert_no_secrets(html, secrets)` then checks);
- `wait_for_text(driver, text)` for a live page, `reload=True` for a server-rendered one;
  `wait_for(driver, condition)` for anything else;
- `click(driver, label, within=None)`: a button or link by its text, then the next page;
- `navigation_status(driver)`: the HTTP status of the page shown;
- `table_row(driver, first_cell)`;
- `accessibility_violations(driver)`: what axe-core finds against WCAG 2.1 AA;
- `wait_for_approval(driver, what)`, `approval_card(driver, what)`,
  `answer_approval(driver, what, "approve", scope="once")`: the approvals inbox.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import (
    StaleElementReferenceException,
    TimeoutException,
    WebDriverException,
)
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select, WebDriverWait

__all__ = ["WebDriver", "accessibility_violations", "answer_approval", "approval_card",
           "artifacts_dir", "assert_no_secrets", "click", "navigation_status", "open_page",
           "page_html", "pages_seen", "save_artifacts", "sign_in", "start_browser",
           "stop_browser", "table_row", "wait_for", "wait_for_approval", "wait_for_text"]

TIMEOUT = 10.0
REPO = Path(__file__).resolve().parents[2]
FLAGS = [
    "--headless=new",
    "--no-sandbox",  # (tests run as root, where Chromium's sandbox cannot start)
    "--disable-dev-shm-usage",
    "--window-size=1280,900",
    "--no-proxy-server",  # the console is on loopback; nothing leaves the machine
    "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-extensions",
    "--disable-features=Translate,OptimizationHints,MediaRouter",
    "--password-store=basic", "--use-mock-keychain",
]
_SEEN: weakref.WeakKeyDictionary[WebDriver, list[tuple[str, str]]] = \
    weakref.WeakKeyDictionary()
_PROFILES: weakref.WeakKeyDictionary[WebDriver, Path] = weakref.WeakKeyDictionary()


def artifacts_dir() -> Path:
    """Where failing browser tests leave a screenshot and the page's HTML:
    `$SANDBOX_GATEWAY_TEST_ARTIFACTS`, else build/test-artifacts (git-ignored)."""
    configured = os.environ.get("SANDBOX_GATEWAY_TEST_ARTIFACTS")
    return Path(configured) if configured else REPO / "build" / "test-artifacts"


def _tools() -> tuple[str, str]:
    chromium = shutil.which("chromium")
    chromedriver = shutil.which("chromedriver")
    missing = [name for name, found in (("chromium", chromium),
                                        ("chromium-driver", chromedriver)) if not found]
    if missing or chromium is None or chromedriver is None:
        pytest.fail(f"{' and '.join(missing)} not installed: run `make tools` "
                    "(scripts/test-tools.sh installs Debian's chromium and chromium-driver)",
                    pytrace=False)
    return chromium, chromedriver


def start_browser(flags: Iterable[str] = ()) -> WebDriver:
    """A headless Chromium on a fresh profile, driven through Debian's chromedriver
    (Selenium's own driver download is never used: both paths are given); `flags`:
    more of Chromium's switches (a test's host mapping)."""
    chromium, chromedriver = _tools()
    profile = Path(tempfile.mkdtemp(prefix="sgw-chromium-"))
    options = Options()
    options.binary_location = chromium
    for flag in (*FLAGS, *flags, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    # (Chromium's crash handler, which leaves the process tree, keeps its database under
    # the XDG config folder: in the profile too, so it is found and removed with it)
    env = {**os.environ, "XDG_CONFIG_HOME": str(profile / "config"),
           "XDG_CACHE_HOME": str(profile / "cache")}
    try:
        driver = webdriver.Chrome(options=options, service=Service(chromedriver, env=env))
    except Exception:
        shutil.rmtree(profile, ignore_errors=True)
        raise
    driver.set_page_load_timeout(30)
    _PROFILES[driver] = profile
    _SEEN[driver] = []
    return driver


def _children() -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":  # (a zombie has ended; its parent reaps it)
            found.setdefault(int(fields[1]), []).append(int(entry.name))
    return found


def _tree(pid: int) -> set[int]:
    """`pid` and every live process under it."""
    children, found, todo = _children(), set(), [pid]
    while todo:
        current = todo.pop()
        found.add(current)
        todo.extend(children.get(current, []))
    return found


def _using(path: Path) -> set[int]:
    """Live processes whose command line names `path` (a browser's profile)."""
    needle = str(path).encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "cmdline").read_bytes():
                    found.add(int(entry.name))
            except OSError:
                continue
    return _alive(found)


def _alive(pids: Iterable[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if state[state.rindex(")") + 2:].split()[0] != "Z":
            alive.add(pid)
    return alive


def stop_browser(driver: WebDriver, timeout: float = 10.0) -> None:
    """Quit the driver and check that chromedriver and every Chromium process it started
    have ended (any left is killed, by its pid, and the test fails)."""
    process = driver.service.process
    profile = _PROFILES.pop(driver, None)
    started = (_tree(process.pid) if process is not None else set()) | \
        (_using(profile) if profile is not None else set())
    try:
        driver.quit()
    finally:
        deadline = time.monotonic() + timeout
        while _alive(started) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = _alive(started)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if profile is not None:
            shutil.rmtree(profile, ignore_errors=True)
    assert not left, f"Chromium processes still running after quit: {sorted(left)}"


def save_artifacts(driver: WebDriver, name: str) -> list[Path]:
    """A screenshot and the page's HTML (with its URL) as `<artifacts>/<name>.png/.html`."""
    directory = artifacts_dir()
    directory.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")[:150]
    saved = []
    png, html = directory / f"{stem}.png", directory / f"{stem}.html"
    if driver.save_screenshot(str(png)):
        saved.append(png)
    html.write_text(f"<!-- {driver.current_url} -->\n{driver.page_source}")
    saved.append(html)
    return saved


def wait_for[T](driver: WebDriver, condition: Callable[[WebDriver], T],
                timeout: float = TIMEOUT, message: str = "") -> T:
    """What `condition` returns once truthy (it is retried every 0.1 s)."""
    try:
        found = WebDriverWait(driver, timeout, poll_frequency=0.1,
                              ignored_exceptions=(StaleElementReferenceException,)
                              ).until(condition, message)
    except TimeoutException as exc:
        raise AssertionError(f"{message or 'condition'} not met within {timeout:g}s on "
                             f"{driver.current_url}") from exc
    return found


def _body_text(driver: WebDriver) -> str:
    return str(driver.find_element(By.TAG_NAME, "body").text)


def wait_for_text(driver: WebDriver, text: str, timeout: float = TIMEOUT,
                  reload: bool = False) -> None:
    """Wait until the page shows `text`. A live page updates itself; `reload=True`
    reloads a server-rendered one until it does."""
    def shown(d: WebDriver) -> bool:
        if text in _body_text(d):
            return True
        if reload:
            d.refresh()
        return False
    try:
        wait_for(driver, shown, timeout, f"{text!r} shown")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the page shows:\n{_body_text(driver)}") from None


def page_html(driver: WebDriver) -> str:
    """The current page's HTML (remembered: `pages_seen`)."""
    html = str(driver.page_source)
    _SEEN.setdefault(driver, []).append((str(driver.current_url), html))
    return html


def pages_seen(driver: WebDriver) -> list[tuple[str, str]]:
    """(url, html) of every page read through `page_html`, `open_page` or `sign_in`."""
    return list(_SEEN.get(driver, []))


def assert_no_secrets(html: str, secrets: Iterable[str], where: str = "page") -> None:
    """None of `secrets` (nor a sizeable piece of one) is in `html`."""
    for secret in secrets:
        assert len(secret) >= 16, "a secret too short to look for"
        pieces = {secret[i:i + 16] for i in range(0, len(secret) - 15, 8)}
        found = [p for p in pieces if p in html]
        assert not found, f"a secret ({secret[:4]}...) is in the {where}'s HTML: {found[0]}"


def open_page(driver: WebDriver, url: str) -> str:
    """Go to `url` and return its HTML (remembered)."""
    driver.get(url)
    return page_html(driver)


def navigation_status(driver: WebDriver) -> int:
    """The HTTP status of the page shown (Navigation Timing's responseStatus)."""
    status = driver.execute_script(
        "const n = performance.getEntriesByType('navigation')[0];"
        "return n ? n.responseStatus : 0;")
    return int(status)


def click(driver: WebDriver, label: str, within: WebElement | None = None) -> None:
    """Click the button (or link) whose visible text is `label`, and wait for the page it
    leads to."""
    scope = within or driver.find_element(By.TAG_NAME, "body")
    literal = _xpath_literal(label)
    target = scope.find_element(
        By.XPATH, f".//button[normalize-space()={literal}] | .//a[normalize-space()={literal}]")
    old = driver.find_element(By.TAG_NAME, "html")
    target.click()
    wait_for(driver, lambda d: _gone(old), message=f"the page after {label!r}")


def _gone(element: WebElement) -> bool:
    """Whether `element`'s page has been replaced. Chromium says so as a stale element,
    or, when the next page replaces it during the check, as an inspector error naming a
    node that does not belong to the document (seen once the admin API answered without
    its 40 ms delayed-ACK wait)."""
    try:
        element.is_enabled()
    except StaleElementReferenceException:
        return True
    except WebDriverException as exc:
        if "does not belong to the document" not in str(exc.msg):
            raise
        return True
    return False


def _xpath_literal(text: str) -> str:
    if "'" not in text:
        return f"'{text}'"
    if '"' not in text:
        return f'"{text}"'
    return "concat(" + ", \"'\", ".join(f"'{part}'" for part in text.split("'")) + ")"


def sign_in(driver: WebDriver, admin_url: str, token: str) -> None:
    """Sign in to the console on `admin_url` with the admin token, as a person does
    (typed into the form); lands on the page the console opens with."""
    open_page(driver, f"{admin_url}/console/login")
    driver.find_element(By.ID, "token").send_keys(token)
    click(driver, "Sign in")
    page_html(driver)


def table_row(driver: WebDriver, first_cell: str) -> WebElement:
    """The table row whose first cell reads `first_cell`."""
    return driver.find_element(
        By.XPATH, f"//tr[td[1][normalize-space()={_xpath_literal(first_cell)}]]")


def approval_card(driver: WebDriver, what: str) -> WebElement:
    """The inbox's card of the pending ask `what` (as its heading says it)."""
    return driver.find_element(
        By.XPATH, f"//section[h3[normalize-space()={_xpath_literal(what)}]]")


def wait_for_approval(driver: WebDriver, what: str, timeout: float = TIMEOUT) -> WebElement:
    """Reload the approvals page until the pending ask `what` is in its inbox; its card."""
    def card(d: WebDriver) -> WebElement | bool:
        found = d.find_elements(
            By.XPATH, f"//section[h3[normalize-space()={_xpath_literal(what)}]]")
        if found:
            return found[0]
        d.refresh()
        return False
    found = wait_for(driver, card, timeout, f"the pending ask {what!r}")
    assert isinstance(found, WebElement)
    return found


def answer_approval(driver: WebDriver, what: str, decision: str, scope: str = "once",
                    duration: str = "", note: str = "") -> None:
    """On the approvals page: answer the pending ask `what` ("approve" or "deny") with
    `scope`, `duration` and `note`, and wait for the page that says what happened."""
    card = approval_card(driver, what)
    Select(card.find_element(By.NAME, "scope")).select_by_value(scope)
    if duration:
        card.find_element(By.NAME, "duration").send_keys(duration)
    if note:
        card.find_element(By.NAME, "note").send_keys(note)
    click(driver, {"approve": "Approve", "deny": "Deny"}[decision], within=card)
    page_html(driver)


def accessibility_violations(driver: WebDriver) -> list[str]:
    """The WCAG 2.1 A and AA violations axe-core finds on the page shown (each as `rule:
    what, where`); axe is injected through WebDriver, which the page's CSP does not
    govern."""
    from helpers.node_clients import axe_core

    driver.execute_script(axe_core().read_text())
    found = driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "axe.run(document, {runOnly: {type: 'tag', values: "
        "['wcag2a', 'wcag2aa', 'wcag21a', 'wcag21aa']}})"
        ".then(r => done(r.violations.map(v => v.id + ': ' + v.help + ', at ' + "
        "v.nodes.map(n => n.target.join(' ')).slice(0, 3).join('; '))))"
        ".catch(e => done(['axe failed: ' + e]));")
    return [str(v) for v in found]
