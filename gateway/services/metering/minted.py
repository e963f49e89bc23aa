"""The answer to a secret-minting call as the sandbox receives it: every secret the
provider minted replaced by an alias (pure, no I/O).

On a rule with ``allow_minted_secrets: true`` the provider's answer (OpenAI Realtime
client secrets and sessions, ChatKit sessions, Gemini auth tokens, Azure OpenAI
Realtime sessions) is held whole (``Exchange.holds_response``) and given to
``release``, which

* finds the secrets it carries (``minted_secrets``: the shapes below);
* draws an alias for each (``alias_for``): the provider's prefix (``ek_``,
  ``auth_tokens/``) so that clients checking the shape accept it, then random
  characters of the secret's alphabet and length (at least 128 random bits), never
  derived from the secret;
* replaces every occurrence of each secret in the answer's strings by its alias, and
  refuses to relay an answer that still carries a secret in any encoding the leak
  scan knows (a secret it cannot find and replace never reaches the sandbox);
* keeps ``alias -> (secret, credential, sandbox, expiry)`` in the ephemeral store
  (``EphemeralKeys``; the state store shares it with every worker and replica),
  where the gateway finds the secret when the sandbox sends the alias back
  (``gateway.core.credentials.plan``). Expiry: the answer's, at most a day away.

Neither the secret nor the alias is logged or audited here.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import secrets
import string
from typing import Any

from gateway.core.leak_forms import canonical, sensitive_markers
from gateway.core.metering.jsondoc import document
from gateway.core.secret_value import SecretValue
from gateway.services.secrets.ephemeral import EphemeralKey, EphemeralKeys

__all__ = ["NOT_FOUND", "alias_for", "expiry", "minted_secrets", "release", "rewrite"]

MINTED_TTL = 600.0  # a minted secret whose expiry the answer does not say lives this long
MINTED_MAX = 86400.0  # and none is kept longer than a day
_SHORTEST, _LONGEST = 8, 4096  # a secret's length, outside which it is not one
_RANDOM_BITS = 128  # the least randomness of an alias
_DEPTH = 16  # how deep a client_secret is looked for
# A provider's prefix: lower-case words joined by `_` ending in `_`, `-` or `/`.
_PREFIX = re.compile(r"[a-z]{1,12}(?:_[a-z]{1,12})?[_/-]")
_HEX = "0123456789abcdef"
_ALNUM = string.ascii_letters + string.digits
_URLSAFE = _ALNUM + "-_"
_JSON = json.JSONDecoder()

NOT_FOUND = ("the provider's answer to a secret-minting call did not name a secret the "
             "gateway can replace by an alias, so it was not relayed")
_STILL_THERE = ("the provider's answer to a secret-minting call carries its secret where "
                "the gateway cannot replace it by an alias (in another field, encoded), so "
                "it was not relayed")


def expiry(value: Any, now: float) -> float:
    """An expiry (Unix seconds, or RFC 3339 text), bounded to a day from now."""
    when: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            when = float(value)
        except OverflowError:  # (an integer past any float)
            when = None
        if when is not None and not math.isfinite(when):
            when = None
    elif isinstance(value, str):
        try:
            when = dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            when = None
    if when is None or when <= now:
        when = now + MINTED_TTL
    return min(when, now + MINTED_MAX)


def minted_secrets(doc: Any, now: float) -> list[tuple[str, float]]:
    """The secrets (value, expiry) a provider's minting answer carries: OpenAI client
    secrets (``value``), Realtime sessions, OpenAI's and Azure's (``client_secret.value``),
    ChatKit sessions (``client_secret``), Gemini auth tokens (``name``); a
    ``client_secret`` is looked for at every depth (a session inside the answer)."""
    if not isinstance(doc, dict):
        return []
    found = _client_secrets(doc, now, 0)
    if isinstance(doc.get("value"), str):
        found.append((doc["value"], expiry(doc.get("expires_at"), now)))
    name = doc.get("name")
    if isinstance(name, str) and name.startswith("auth_tokens/"):
        found.append((name, expiry(doc.get("expireTime"), now)))
    return [(v, e) for v, e in found if _SHORTEST <= len(v) <= _LONGEST]


def _client_secrets(node: Any, now: float, depth: int) -> list[tuple[str, float]]:
    """Every ``client_secret`` in `node` (an object: its ``value``; a string)."""
    found: list[tuple[str, float]] = []
    if depth > _DEPTH:
        return found
    if isinstance(node, list):
        for item in node:
            found += _client_secrets(item, now, depth + 1)
        return found
    if not isinstance(node, dict):
        return found
    secret = node.get("client_secret")
    if isinstance(secret, dict) and isinstance(secret.get("value"), str):
        found.append((secret["value"], expiry(secret.get("expires_at"), now)))
    elif isinstance(secret, str):
        found.append((secret, expiry(node.get("expires_at"), now)))
    for key, value in node.items():
        if key != "client_secret" and isinstance(value, dict | list):
            found += _client_secrets(value, now, depth + 1)
    return found


def alias_for(secret: str) -> str:
    """A new alias of `secret`'s shape: its provider prefix, then random characters of
    its alphabet (hex, letters and digits, or URL-safe base64) and length, at least
    128 random bits. Only the prefix is taken from the secret."""
    match = _PREFIX.match(secret)
    prefix = match.group() if match is not None and match.end() < len(secret) else ""
    rest = secret[len(prefix):]
    alphabet = (_HEX if all(c in _HEX for c in rest) else
                _ALNUM if rest.isascii() and rest.isalnum() else _URLSAFE)
    length = max(len(rest), math.ceil(_RANDOM_BITS / math.log2(len(alphabet))))
    return prefix + "".join(secrets.choice(alphabet) for _ in range(length))


def _replaced(node: Any, aliases: dict[str, str]) -> Any:
    """`node` with every occurrence of a secret in its strings (keys too) replaced."""
    if isinstance(node, str):
        for value, alias in aliases.items():  # (longest first: see `rewrite`)
            if value in node:
                node = node.replace(value, alias)
        return node
    if isinstance(node, dict):
        return {_replaced(k, aliases): _replaced(v, aliases) for k, v in node.items()}
    if isinstance(node, list):
        return [_replaced(v, aliases) for v in node]
    return node


def rewrite(doc: Any, aliases: dict[str, str]) -> bytes | None:
    """The answer `doc` with each secret replaced by its alias, as JSON; None when a
    secret is still in it in an encoding the leak scan knows (base64, hex, escaped…)."""
    longest_first = dict(sorted(aliases.items(), key=lambda item: -len(item[0])))
    out = json.dumps(_replaced(doc, longest_first), ensure_ascii=False).encode()
    text = canonical(out)
    for value in aliases:
        if any(marker in text for marker in sensitive_markers(value.encode())):
            return None
    return out


def release(keys: EphemeralKeys, *, credential: str, sandbox: str, status: int,
            body: bytes) -> bytes | str:
    """A held answer to a secret-minting call: the answer to relay, each secret replaced
    by an alias kept in `keys` (for `sandbox`, bound to `credential`), or why it cannot
    be relayed. An answer that is not a success minted nothing: relayed as it is."""
    if not 200 <= status < 300:
        return body
    now = keys.clock()
    try:
        doc = document(body, _JSON)
    except ValueError:
        return NOT_FOUND
    found: dict[str, float] = {}
    for value, expires_at in minted_secrets(doc, now):
        found[value] = min(expires_at, found.get(value, expires_at))
    if not found:
        return NOT_FOUND
    aliases = {value: alias_for(value) for value in found}
    out = rewrite(doc, aliases)
    if out is None:
        return _STILL_THERE
    for value, expires_at in found.items():
        keys.add(EphemeralKey(credential, sandbox, SecretValue(value), expires_at,
                              SecretValue(aliases[value])))
    return out
