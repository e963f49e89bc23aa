"""The logging boundary's redaction (gateway/observability/logs.py): every known secret and every
gateway token, in every encoding the leak scanner knows, in messages and tracebacks;
markers rebuilt only when a source changes; mitmproxy's own log lines cut before the
bytes they quote."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote

import pytest

from gateway.core.leak_forms import sensitive_markers, token_markers
from gateway.core.leaks import LeakScan
from gateway.core.secret_value import MintedValue, SecretValue
from gateway.engines import patches
from gateway.observability.logs import (
    REDACTED,
    REDACTION,
    WITHHELD,
    Redaction,
    SecretSources,
    protect,
    token_claims,
)
from gateway.services.identity.signing_keys import SigningKeys
from gateway.services.identity.tokens import TokenService
from gateway.services.secrets.base import SecretNotFound
from gateway.services.secrets.cache import SecretCache
from gateway.services.state.base import MemoryState

KEY = "sk-unit-real-key-0123456789abcdef"
PART = "AKIAUNITTESTKEYID0001"  # a part of a composite minted value (AWS)
SECRET_PART = "unit/secret+access/key0123456789ABCDEFGH"


@pytest.fixture(scope="module")
def token(tmp_path_factory: pytest.TempPathFactory) -> str:
    keys = SigningKeys.load(tmp_path_factory.mktemp("keys"))
    service = TokenService(keys, MemoryState(), lambda name: [])
    return service.mint("sbx-1", "agent").token


@pytest.fixture
def redaction() -> Redaction:
    sources = SecretSources()
    sources.add("keys", lambda: [SecretValue(KEY),
                                 MintedValue("composite", parts=(PART, SECRET_PART))])
    sources.add("claims", lambda: [token_claims("sandbox-gateway")])
    return Redaction(sources)


def _scan(token: str) -> LeakScan:
    secrets = [m for v in (KEY, PART, SECRET_PART) for m in sensitive_markers(v.encode())]
    return LeakScan(token_markers(token, "sandbox-gateway"), secrets)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


ENCODED = {
    "raw": lambda v: v,
    "upper": lambda v: v.upper(),
    "base64": _b64,
    "base64url": lambda v: base64.urlsafe_b64encode(v.encode()).decode().rstrip("="),
    "in basic auth": lambda v: "Basic " + _b64(f"user:{v}"),
    "inside a longer base64 blob": lambda v: _b64(f'{{"a": 1, "key": "{v}", "z": 2}}'),
    "hex": lambda v: v.encode().hex(),
    "HEX": lambda v: v.encode().hex().upper(),
    "base32": lambda v: base64.b32encode(v.encode()).decode(),
    "url": lambda v: quote(v, safe=""),
    "url twice": lambda v: quote(quote(v, safe=""), safe=""),
    "json escapes": lambda v: "".join(f"\\u00{b:02x}" for b in v.encode()),
    "repr bytes": lambda v: repr(v.encode()),
}
VALUES = {"key": lambda t: KEY, "minted part": lambda t: SECRET_PART, "token": lambda t: t,
          "token without header": lambda t: t.split(".", 1)[1]}


@pytest.mark.parametrize("encoding", list(ENCODED))
@pytest.mark.parametrize("value", list(VALUES))
def test_every_encoding_of_every_secret_is_cut(redaction: Redaction, token: str,
                                               value: str, encoding: str) -> None:
    secret = ENCODED[encoding](VALUES[value](token))
    out = redaction.redact(f"upstream said: {secret} (and more words)")
    assert _scan(token).find(out.encode()) is None, out
    assert REDACTED in out or out == WITHHELD
    if encoding in ("raw", "base64", "hex"):
        assert out.startswith("upstream said: ") and out.endswith(" (and more words)"), out


def test_text_without_a_secret_is_unchanged(redaction: Redaction) -> None:
    for text in ("client connect", "upstream api.openai.com:443 failed (protocol): illegal "
                 "status line [quoted data withheld]", "100% done \\o/", ""):
        assert redaction.redact(text) == text


def _emit(redaction: Redaction, call: str, *args: object) -> str:
    """What a handler carrying `redaction` writes for one logging call."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(redaction)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log = logging.getLogger(f"test_logs.{call}")
    log.propagate = False
    log.addHandler(handler)
    try:
        if call == "exception":
            try:
                raise ValueError(f"upstream sent {args[0]}")
            except ValueError:
                log.exception("failed: %s", *args)
        elif call == "stack":
            log.warning("here %s", *args, stack_info=True)
        elif call == "unformattable":
            log.warning("two %s %s", *args)
        else:
            log.warning(*args)  # type: ignore[call-overload]
    finally:
        log.removeHandler(handler)
    return stream.getvalue()


def test_messages_arguments_and_tracebacks_are_redacted(redaction: Redaction,
                                                        token: str) -> None:
    for call, args in (("exception", (KEY,)), ("stack", (token,)),
                       ("unformattable", (KEY,)), ("plain", ("key %s", KEY)),
                       ("plain", ("token %r in %s", token.encode(), "a header"))):
        out = _emit(redaction, call, *args)
        assert out, call
        assert _scan(token).find(out.encode()) is None, out
    assert "Traceback" in _emit(redaction, "exception", KEY)  # kept, redacted
    assert "its arguments did not format" in _emit(redaction, "unformattable", KEY)


def test_markers_are_rebuilt_only_when_a_source_changes() -> None:
    calls: list[int] = []
    values = ["first-secret-value-0001"]

    def source() -> list[str]:
        calls.append(1)
        return list(values)

    sources = SecretSources()
    sources.add("counted", source)
    redaction = Redaction(sources)
    for _ in range(100):
        redaction.redact("nothing secret here")
    assert len(calls) == 1
    values.append("second-secret-value-0002")
    assert "second" in redaction.redact("second-secret-value-0002")  # not known yet
    sources.changed()
    assert redaction.redact("second-secret-value-0002") == REDACTED
    assert len(calls) == 2
    sources.remove("counted")
    assert redaction.redact("first-secret-value-0001") == "first-secret-value-0001"


def test_a_failing_source_keeps_the_last_markers() -> None:
    sources = SecretSources()
    ok = [True]

    def source() -> list[str]:
        if not ok[0]:
            raise RuntimeError("store gone")
        return [KEY]

    sources.add("flaky", source)
    redaction = Redaction(sources)
    assert redaction.redact(KEY) == REDACTED
    ok[0] = False
    sources.changed()
    assert redaction.redact(KEY) == REDACTED  # and logging did not raise


def test_short_values_are_no_markers() -> None:
    sources = SecretSources()
    sources.add("short", lambda: ["abc", SecretValue("1234567")])
    assert Redaction(sources).redact("abc 1234567 616263") == "abc 1234567 616263"


class _Store:
    name = "fake"

    def __init__(self) -> None:
        self.values = {"k": "sk-cache-value-one-0123456789"}

    async def fetch(self, name: str) -> SecretValue:
        if name not in self.values:
            raise SecretNotFound(name, "no such secret")
        return SecretValue(self.values[name])

    async def close(self) -> None:
        pass


def test_the_secret_cache_signals_new_values() -> None:
    """The gateway wires `on_change` to `SOURCES.changed`: a value fetched for the first
    time, or a rotated one, moves the version; the same value fetched again does not."""
    sources = SecretSources()
    store = _Store()
    clock = [0.0]
    cache = SecretCache(store, ttl=10, refresh_ahead=1, clock=lambda: clock[0],  # type: ignore[arg-type]
                        on_change=sources.changed)
    sources.add("cache", cache.known_values)
    redaction = Redaction(sources)
    before = sources.version

    async def scenario() -> None:
        await cache.get("k")
        assert sources.version == before + 1
        assert redaction.redact("sk-cache-value-one-0123456789") == REDACTED
        clock[0] = 20.0
        await cache.get("k")  # refetched, the same value
        assert sources.version == before + 1
        store.values["k"] = "sk-cache-value-two-0123456789"
        clock[0] = 40.0
        await cache.get("k")  # rotated
        assert sources.version == before + 2
        assert redaction.redact("sk-cache-value-two-0123456789") == REDACTED

    asyncio.run(scenario())


@pytest.fixture
def named_handler() -> Iterator[logging.Handler]:
    handler = logging.StreamHandler(io.StringIO())
    log = logging.getLogger("test_logs.protect")
    log.addHandler(handler)
    yield handler
    log.removeHandler(handler)


def test_protect_reaches_every_handler_once(named_handler: logging.Handler) -> None:
    protect()
    protect()
    assert named_handler.filters.count(REDACTION) == 1
    assert REDACTION in logging.getLogger().handlers[0].filters or not logging.getLogger().handlers


def test_configure_redacts_the_root_handler_and_quiets_hpack(tmp_path: Path) -> None:
    """`run`'s set-up, in a fresh interpreter (it configures the root logger)."""
    script = f"""
import logging
from gateway.observability.logs import SOURCES, configure
configure("debug")
SOURCES.add("t", lambda: [{KEY!r}])
logging.getLogger("sandbox_gateway").info("key %s", {KEY!r})
logging.getLogger("hpack.hpack").debug("Decoded header block with a key")
logging.getLogger("mitmproxy.proxy.server").info("info from mitmproxy")
print(logging.getLogger("hpack").getEffectiveLevel(),
      logging.getLogger("mitmproxy").getEffectiveLevel())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(logging.INFO), str(logging.WARNING)]
    assert f"key {REDACTED}" in out.stderr and KEY not in out.stderr
    assert "Decoded header block" not in out.stderr and "info from mitmproxy" not in out.stderr


def test_mitmproxy_log_lines_are_cut_before_quoted_bytes(caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    from gateway.core.phrases import error_phrase

    patches.install_log_hygiene(error_phrase)
    from mitmproxy.proxy import server

    handler = SimpleNamespace(client=SimpleNamespace(peername=("127.0.0.1", 1)))
    with caplog.at_level(logging.INFO, logger="mitmproxy.proxy.server"):
        server.ConnectionHandler.log(handler, f"Unexpected data from server: b'{KEY}'")  # type: ignore[arg-type]
    assert "Unexpected data from server [quoted data withheld]" in caplog.text
    assert KEY not in caplog.text
    assert json.dumps(caplog.text)  # (a plain string)
