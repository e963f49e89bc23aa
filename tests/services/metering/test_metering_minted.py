"""A provider's answer to a secret-minting call, as the sandbox receives it
(`gateway/services/metering/minted.py`): every secret replaced by a fresh alias of its
shape, kept with the secret in the ephemeral store; an answer whose secret cannot be
found and replaced is not relayed. One row per answer shape the providers give."""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import pytest
from helpers.clock import Clock

from gateway.core.leak_forms import canonical, sensitive_markers
from gateway.services.metering import minted
from gateway.services.secrets.ephemeral import EphemeralKeys

NOW = 1_795_000_000.0
EK = "ek_68af296e8e408191a1120ab6383263c2"  # OpenAI's shape: ek_ + 32 hex
GEMINI = "auth_tokens/c2b1a9f0e5d74a3b8e6f1d2c3b4a5968"
AZURE = "eyJhbGciOi-J9.QmFzZTY0LWxpa2Vfb3BhcXVl_LXRva2Vu"  # an opaque token
CHATKIT = "ek_chatkit_1a2B3c4D5e6F7g8H9i0J"


def _openai_client_secret(secret: str) -> dict[str, Any]:
    """POST /v1/realtime/client_secrets (also /translations/client_secrets)."""
    return {"value": secret, "expires_at": NOW + 600, "session": {
        "type": "realtime", "object": "realtime.session", "id": "sess_C9", "model":
        "gpt-realtime", "instructions": "", "tools": [], "expires_at": 0}}


def _session(secret: str) -> dict[str, Any]:
    """POST /v1/realtime/sessions, /transcription_sessions, Azure
    /openai/realtimeapi/sessions."""
    return {"id": "sess_C9", "object": "realtime.session", "model": "gpt-4o-realtime-preview",
            "modalities": ["audio", "text"],
            "client_secret": {"value": secret, "expires_at": NOW + 60}}


def _chatkit(secret: str) -> dict[str, Any]:
    """POST /v1/chatkit/sessions."""
    return {"id": "cksess_123", "object": "chatkit.session", "client_secret": secret,
            "expires_at": NOW + 600, "workflow": {"id": "wf_1"}, "user": "u-1"}


def _gemini(secret: str) -> dict[str, Any]:
    """POST /v1alpha/auth_tokens."""
    return {"name": secret, "uses": 1, "expireTime": "2026-11-18T20:00:00Z",
            "newSessionExpireTime": "2026-11-18T11:08:00Z"}


def _store() -> EphemeralKeys:
    clock = Clock()
    clock.now = NOW
    return EphemeralKeys(clock)


def _secret_in(out: bytes, secret: str) -> bool:
    text = canonical(out)
    return any(m in text for m in sensitive_markers(secret.encode()))


@pytest.mark.parametrize(("answer", "secret", "where", "expires_at"), [
    (_openai_client_secret(EK), EK, ("value",), NOW + 600),
    (_session(EK), EK, ("client_secret", "value"), NOW + 60),
    (_session(AZURE), AZURE, ("client_secret", "value"), NOW + 60),
    (_chatkit(CHATKIT), CHATKIT, ("client_secret",), NOW + 600),
    (_gemini(GEMINI), GEMINI, ("name",), 1_795_032_000.0),  # its RFC 3339 expireTime
], ids=["openai-client-secret", "realtime-session", "azure-session", "chatkit", "gemini"])
def test_each_answer_shape_carries_an_alias(answer: dict[str, Any], secret: str,
                                            where: tuple[str, ...], expires_at: float) -> None:
    keys = _store()
    out = minted.release(keys, credential="openai", sandbox="sb", status=200,
                         body=json.dumps(answer).encode())
    assert isinstance(out, bytes)
    assert not _secret_in(out, secret)  # the secret's bytes, in no encoding
    relayed = json.loads(out)
    alias = relayed
    for field in where:
        alias = alias[field]
    assert isinstance(alias, str) and alias != secret
    # The rest of the answer is the provider's.
    stripped = json.loads(json.dumps(answer).replace(secret, "X"))
    assert json.loads(out.decode().replace(alias, "X")) == stripped
    [key] = keys.live()
    assert key.alias is not None and key.alias.equals(alias) and key.value.equals(secret)
    assert (key.credential, key.sandbox) == ("openai", "sb")
    assert key.expires_at == min(expires_at, NOW + 86400)
    found = keys.by_alias(alias)
    assert found is not None and found.value.equals(secret)
    assert keys.by_alias(secret) is None


@pytest.mark.parametrize(("secret", "prefix", "pattern"), [
    (EK, "ek_", r"ek_[0-9a-f]{32}"),
    ("ek_1234abcd", "ek_", r"ek_[0-9a-f]{32}"),  # short: still 128 random bits
    (GEMINI, "auth_tokens/", r"auth_tokens/[0-9a-f]{32}"),
    (CHATKIT, "ek_chatkit_", r"ek_chatkit_[A-Za-z0-9]{22}"),
    (AZURE, "", r"[A-Za-z0-9_-]{47}"),  # no provider prefix: nothing of the secret kept
    ("Abcdef-0123456789abcdefghij", "", r"[A-Za-z0-9_-]{27}"),
])
def test_an_alias_has_the_secrets_shape_and_nothing_else_of_it(secret: str, prefix: str,
                                                                pattern: str) -> None:
    aliases = {minted.alias_for(secret) for _ in range(50)}
    assert len(aliases) == 50  # random each time, never derived from the secret
    for alias in aliases:
        assert re.fullmatch(pattern, alias), alias
        assert alias.startswith(prefix) and secret[len(prefix):] not in alias


def test_every_copy_is_replaced_and_each_secret_gets_its_own_alias() -> None:
    """A secret also named elsewhere in the answer (a nested copy, inside a longer
    string, as a key) is replaced everywhere; a client_secret is found at any depth;
    two secrets get two aliases."""
    other = "ek_ffffffffeeeeeeeeddddddddcccccccc"
    answer = {"value": EK, "expires_at": NOW + 600, "session": {
        "client_secret": {"value": other, "expires_at": NOW + 30},
        "note": f"use {EK} soon", EK: [EK, {"x": EK}]}}
    keys = _store()
    out = minted.release(keys, credential="openai", sandbox="sb", status=200,
                         body=json.dumps(answer).encode())
    assert isinstance(out, bytes)
    assert not _secret_in(out, EK) and not _secret_in(out, other)
    doc = json.loads(out)
    first, second = doc["value"], doc["session"]["client_secret"]["value"]
    assert first != second
    assert doc["session"]["note"] == f"use {first} soon"
    assert doc["session"][first] == [first, {"x": first}]
    assert {(k.value.reveal(), k.alias.reveal() if k.alias else None, k.expires_at)
            for k in keys.live()} == {(EK, first, NOW + 600), (other, second, NOW + 30)}


@pytest.mark.parametrize(("body", "status"), [
    (b"not json", 200),
    (b'["ek_68af296e8e408191a1120ab6383263c2"]', 200),  # not an object
    (b'{"id": "sess_1", "object": "realtime.session"}', 200),  # names no secret
    (b'{"value": "short"}', 201),  # too short to be one
    (b'{"client_secret": {"value": 42}}', 200),
], ids=["not-json", "array", "no-secret", "too-short", "not-a-string"])
def test_an_answer_without_a_secret_to_replace_is_not_relayed(body: bytes,
                                                                status: int) -> None:
    keys = _store()
    out = minted.release(keys, credential="openai", sandbox="sb", status=status, body=body)
    assert out == minted.NOT_FOUND and keys.live() == []


@pytest.mark.parametrize("copy", [
    base64.b64encode(EK.encode()).decode(),  # base64 in another field
    base64.urlsafe_b64encode(("x" + EK).encode()).decode(),  # inside a longer blob
    EK.encode().hex(),
    EK.upper(),
], ids=["base64", "base64-inside", "hex", "upper-case"])
def test_a_secret_left_in_another_encoding_is_not_relayed(copy: str) -> None:
    keys = _store()
    body = json.dumps({"value": EK, "expires_at": NOW + 60, "debug": copy}).encode()
    out = minted.release(keys, credential="openai", sandbox="sb", status=200, body=body)
    assert isinstance(out, str) and "cannot replace" in out
    assert EK not in out and keys.live() == []


def test_an_error_answer_minted_nothing() -> None:
    keys = _store()
    body = b'{"error": {"message": "Incorrect API key provided."}}'
    assert minted.release(keys, credential="openai", sandbox="sb", status=401,
                          body=body) == body
    assert keys.live() == []


@pytest.mark.parametrize(("value", "expected"), [
    (NOW + 120, NOW + 120),
    (NOW + 7 * 86400, NOW + 86400),  # at most a day
    (NOW - 5, NOW + 600),  # a past expiry: the default ten minutes
    (None, NOW + 600),
    (True, NOW + 600),
    (10 ** 400, NOW + 600),
    ("2026-11-18T20:00:00Z", 1_795_032_000.0),
    ("2026-11-18T20:00:00+00:00", 1_795_032_000.0),
    ("not a time", NOW + 600),
])
def test_expiry(value: Any, expected: float) -> None:
    assert minted.expiry(value, NOW) == expected
