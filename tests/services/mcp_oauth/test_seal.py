"""The key that seals MCP OAuth tokens: made once (0600), shared by processes starting
together, refused when it is not a key; sealed documents open only with their key and at
the record they were sealed for."""

from __future__ import annotations

import base64
import multiprocessing
import stat
from pathlib import Path

import pytest

from gateway.services.mcp_oauth.seal import Sealer, ensure_key, key_from_secret


def test_the_key_is_made_once_and_private(tmp_path: Path) -> None:
    path = tmp_path / "certs" / "mcp-oauth-key"
    key = ensure_key(path)
    assert len(key) == 32 and ensure_key(path) == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["mcp-oauth-key"]  # (no leftovers)


def _race(path: str, out: multiprocessing.Queue[bytes]) -> None:  # (a child process)
    out.put(ensure_key(Path(path)))


def test_processes_starting_together_agree_on_one_key(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    for round_ in range(5):
        path = tmp_path / f"key-{round_}"
        queue: multiprocessing.Queue[bytes] = context.Queue()
        children = [context.Process(target=_race, args=(str(path), queue)) for _ in range(6)]
        for child in children:
            child.start()
        keys = {queue.get(timeout=20) for _ in children}
        for child in children:
            child.join(20)
        queue.close()
        queue.join_thread()
        assert keys == {path.read_bytes()}


def test_a_file_that_is_no_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"too short")
    with pytest.raises(ValueError, match="does not hold a 32-byte key"):
        ensure_key(path)


def test_a_sealed_document_opens_only_with_its_key_and_record(tmp_path: Path) -> None:
    one, other = Sealer(ensure_key(tmp_path / "a")), Sealer(ensure_key(tmp_path / "b"))
    doc = {"access": "at-123", "refresh": "rt-456"}
    sealed = one.seal(doc, "mcp_oauth_grant|sandbox:a|https://mcp.test/mcp")
    assert "at-123" not in sealed and "rt-456" not in sealed
    assert one.open(sealed, "mcp_oauth_grant|sandbox:a|https://mcp.test/mcp") == doc
    assert one.open(sealed, "mcp_oauth_grant|sandbox:b|https://mcp.test/mcp") is None
    assert other.open(sealed, "mcp_oauth_grant|sandbox:a|https://mcp.test/mcp") is None
    assert one.open("not base64!", "x") is None
    assert one.open(sealed[:-4] + "AAAA", "mcp_oauth_grant|sandbox:a|https://mcp.test/mcp") \
        is None
    assert one.seal(doc, "x") != one.seal(doc, "x")  # (a fresh nonce each time)


KEY = bytes(range(32))


@pytest.mark.parametrize("text", [
    base64.b64encode(KEY).decode(), base64.urlsafe_b64encode(KEY).decode().rstrip("="),
    KEY.hex(), KEY.hex().upper(), f"  {base64.b64encode(KEY).decode()}\n"])
def test_a_key_from_the_secret_store_is_read_as_base64_or_hex(text: str) -> None:
    assert key_from_secret(text) == KEY


@pytest.mark.parametrize("text", [
    "", "not a key", base64.b64encode(KEY[:31]).decode(), base64.b64encode(KEY + b"x").decode(),
    KEY.hex()[:-2], "z" * 64])
def test_a_secret_that_is_no_key_is_refused_without_echoing_it(text: str) -> None:
    with pytest.raises(ValueError) as refused:
        key_from_secret(text)
    assert not text.strip() or text.strip() not in str(refused.value)
