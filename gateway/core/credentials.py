"""The credential swap: the sandbox's token out of its carrier, the real key in.

A carrier is a header (`x-api-key`), `Authorization: Bearer`, `Authorization: Basic`
(the key as password), `Authorization: token` (GitHub) or a query parameter (`?key=`).
Presets list the carriers a provider accepts (Anthropic: `x-api-key` or Bearer); the
key goes into the carrier the client used, or where the credential `places` it (an
Entra ID token always goes as Bearer, whichever carrier held the sandbox's token).
`plan()` finds the token and checks it (this sandbox's, credential and path in scope;
a pod identified by its address carries none: its key slot holds a placeholder)
— or, on a rule with `allow_minted_secrets`, the alias of a secret the provider minted
for this sandbox with this credential (in a carrier of the key, in `Authorization:
Bearer`, in Gemini's `?access_token=` or in a WebSocket subprotocol
`openai-insecure-api-key.<alias>`), which the secret then replaces in the same
carrier — and that the request travels inside TLS — a key never goes over a cleartext
connection: a plain `http://` request on a credential rule is refused
(`credential_requires_tls`), not upgraded. `apply()` places the key (a signing
credential, SigV4, signs instead: `exchange.Signer`). Pure functions over
engine-neutral heads; the value itself comes from the secret cache.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode

from gateway.core.identity import Identity, TokenRefused
from gateway.core.messages import Headers
from gateway.core.policy import Credential, Injection
from gateway.core.refusal import Refusal
from gateway.core.secret_value import SecretValue
from gateway.core.target import Target

__all__ = ["SUBPROTOCOL_KEY", "TOKEN_PREFIX", "Swap", "apply", "find_token", "plan", "shape_of",
           "static_refusal"]

# Every gateway token starts with this base64url text: its JOSE header `{"alg":"EdDSA","kid":`.
TOKEN_PREFIX = base64.urlsafe_b64encode(b'{"alg":"EdDSA","kid":').decode()[:28]

_SHAPES = {"openai": "openai", "azure-openai": "openai", "mistral": "openai",
           "groq": "openai", "openrouter": "openai", "anthropic": "anthropic",
           "gemini": "gemini", "azure-entra": "openai"}


def shape_of(preset: str | None) -> str | None:
    """The error-body family of a provider preset (for refusals on its hosts)."""
    return _SHAPES.get(preset or "")


# Where a provider-minted secret travels besides the key's own carriers: as a bearer
# token (OpenAI, Azure OpenAI), Gemini Live's `access_token`, and a browser's WebSocket
# subprotocol (OpenAI Realtime: `Sec-WebSocket-Protocol: realtime,
# openai-insecure-api-key.<secret>`).
SUBPROTOCOL_KEY = "openai-insecure-api-key."
_SUBPROTOCOL = Injection("header", "sec-websocket-protocol")
_MINTED_CARRIERS = (Injection("bearer"), Injection("query", "access_token"), _SUBPROTOCOL)


@dataclass(frozen=True, slots=True)
class Swap:
    """A checked swap: which credential, in which carrier. ``minted``: the carrier held
    the alias of a secret the provider minted for this sandbox; this secret goes in its
    place (instead of the key)."""

    credential: Credential
    carrier: Injection
    minted: SecretValue | None = None


def _authorization(headers: Headers, scheme: str) -> str | None:
    auth = headers.get("authorization")
    if auth is None:
        return None
    got, _, param = auth.strip().partition(" ")
    return param.strip() if got.lower() == scheme and param.strip() else None


def _query(path: str) -> tuple[str, list[tuple[str, str]]]:
    base, sep, query = path.partition("?")
    return base, parse_qsl(query, keep_blank_values=True) if sep else []


def _subprotocols(headers: Headers) -> list[str]:
    """The WebSocket subprotocols a request offers (every field line's)."""
    return [p.strip() for value in headers.get_all("sec-websocket-protocol")
            for p in value.split(",") if p.strip()]


def _carried(headers: Headers, path: str, carrier: Injection) -> str | None:
    if carrier == _SUBPROTOCOL:
        return next((p[len(SUBPROTOCOL_KEY):] for p in _subprotocols(headers)
                     if p.startswith(SUBPROTOCOL_KEY)), None)
    if carrier.kind == "header":
        assert carrier.name is not None
        return headers.get(carrier.name)
    if carrier.kind in ("bearer", "token"):
        return _authorization(headers, carrier.kind)
    if carrier.kind == "query":
        return next((v for k, v in _query(path)[1] if k == carrier.name), None)
    param = _authorization(headers, "basic")
    if param is None:
        return None
    try:
        return base64.b64decode(param, validate=True).decode().partition(":")[2]
    except ValueError:  # binascii.Error, UnicodeDecodeError, non-ASCII input
        return None


def _clear(headers: Headers, path: str, credential: Credential,
           carriers: tuple[Injection, ...] = ()) -> str:
    """Remove every carrier of the credential (and `carriers`); returns the path without
    a query carrier."""
    for carrier in (*credential.injection.carriers, *carriers):
        if carrier == _SUBPROTOCOL:
            offered = _subprotocols(headers)
            others = [p for p in offered if not p.startswith(SUBPROTOCOL_KEY)]
            if len(others) < len(offered):
                headers.remove("sec-websocket-protocol")
                if others:
                    headers.set("Sec-WebSocket-Protocol", ", ".join(others))
        elif carrier.kind == "header":
            assert carrier.name is not None
            headers.remove(carrier.name)
        elif carrier.kind in ("bearer", "basic", "token"):
            if _authorization(headers, carrier.kind) is not None:
                headers.remove("authorization")
        elif carrier.kind == "query":
            base, pairs = _query(path)
            if any(k == carrier.name for k, _ in pairs):
                kept = [(k, v) for k, v in pairs if k != carrier.name]
                path = base + ("?" + urlencode(kept) if kept else "")
    return path


def static_refusal(credential: Credential, scheme: str, host: str,
                   rule: str | None) -> Refusal | None:
    """What refuses a credential call whatever it carries: a cleartext request (a key
    never travels in cleartext) or a host the credential is not bound to."""
    if scheme != "https":
        return Refusal("credential_requires_tls", f"rule {rule or '?'} injects credential "
                       f"{credential.name!r}, and a key never travels in cleartext: send "
                       f"this request over https:// (it went to {host} over http)", rule)
    if not credential.binds(host):
        return Refusal("policy_denied", f"credential {credential.name!r} is not bound to "
                       f"{host}; fix the credential's hosts", rule)
    return None


def plan(credential: Credential, headers: Headers, target: Target, identity: Identity,
         verify: Callable[[str], Identity], rule: str | None,
         minted: Callable[[str], SecretValue | None] | None = None) -> tuple[Swap, str]:
    """Check the swap and take the token out: returns the swap and the request path
    without a query carrier. `verify` is `TokenService.verify`; `minted` (a rule that
    allows provider-minted secrets) finds the secret whose alias a carrier holds, minted
    by this sandbox with this credential (it raises the refusal of another's alias).
    Raises Refusal. (The decision pipeline's `route` has refused a cleartext or unbound
    call already; the check is repeated here, where a key is about to be placed, so no
    caller can skip it: ~0.3 µs.)"""
    refusal = static_refusal(credential, target.scheme, target.host, rule)
    if refusal is not None:
        raise refusal
    if minted is not None:
        found = _minted(credential, headers, target.path, minted)
        if found is not None:
            return found
    for carrier in credential.injection.carriers:
        value = _carried(headers, target.path, carrier)
        if value:
            break
    else:
        if identity.keyless:  # a pod known by its address: no token to carry
            return Swap(credential, credential.places or credential.injection.carriers[0]), \
                _clear(headers, target.path, credential)
        if credential.challenge:  # git asks its credential helper only after a 401
            raise Refusal("credential_required", f"rule {rule or '?'} injects credential "
                          f"{credential.name!r}: send the sandbox token as the password "
                          f"of Authorization: Basic{_other_carriers(credential)}", rule)
        raise Refusal("credential_not_in_scope", f"rule {rule or '?'} injects credential "
                      f"{credential.name!r}, but the request carries no gateway token where "
                      "the provider expects its key; set the API key variable to the "
                      "sandbox token")
    token = value.strip()
    if credential.placeholder and token.startswith(credential.placeholder):
        token = token[len(credential.placeholder):]  # (a key shape the SDK checks; see env)
    if identity.keyless:  # (whatever the key slot holds is a placeholder: replaced)
        return Swap(credential, credential.places or carrier), \
            _clear(headers, target.path, credential)
    try:
        carried = verify(token)
    except TokenRefused as refused:
        # A verified token of this sandbox names itself on the audit line (its jti); the
        # connection's identity stands for any other.
        named = refused.identity
        raise Refusal(refused.code, f"the token in the {credential.name} credential "
                      f"carrier: {refused.reason}",
                      identity=named if named is not None and named.sandbox ==
                      identity.sandbox else None) from None
    if carried.sandbox != identity.sandbox:
        raise Refusal("credential_not_in_scope", "the token in the credential carrier "
                      "belongs to another sandbox; use this sandbox's own token")
    if not carried.allows_credential(credential.name, target.path):
        raise Refusal("credential_not_in_scope", f"the token's scope does not allow "
                      f"credential {credential.name!r} for this path; mint it with "
                      f"--scope {credential.name}")
    path = _clear(headers, target.path, credential)
    return Swap(credential, credential.places or carrier), path


def _other_carriers(credential: Credential) -> str:
    """`` or as …`` for the carriers besides Basic a challenged credential accepts."""
    names = {"bearer": "Authorization: Bearer", "token": "Authorization: token",
             "header": "header {}", "query": "query parameter {}"}
    others = [names[c.kind].format(c.name) for c in credential.injection.carriers
              if c.kind != "basic" and c.kind in names]
    return "".join(f" or as {o}" for o in others)


def _minted(credential: Credential, headers: Headers, path: str,
            minted: Callable[[str], SecretValue | None]) -> tuple[Swap, str] | None:
    """The swap of a provider-minted secret's alias found in a carrier, every carrier
    emptied (the secret goes where the alias was, `apply`); None: no alias."""
    for carrier in (*credential.injection.carriers, *_MINTED_CARRIERS):
        value = _carried(headers, path, carrier)
        if not value or value.strip().startswith(TOKEN_PREFIX):
            continue
        secret = minted(_bare(value.strip()))
        if secret is not None:
            return Swap(credential, carrier, secret), _clear(headers, path, credential,
                                                             _MINTED_CARRIERS)
    return None


def _bare(value: str) -> str:
    """A carried value without the Bearer/token scheme a header carrier may keep."""
    scheme, _, rest = value.partition(" ")
    return rest.strip() if rest and scheme.lower() in ("bearer", "token") else value


def apply(swap: Swap, headers: Headers, path: str, key: str) -> str:
    """Put the real key into the swap's carrier; returns the (possibly new) path."""
    carrier = swap.carrier
    if carrier == _SUBPROTOCOL:
        headers.set("Sec-WebSocket-Protocol", ", ".join([*_subprotocols(headers),
                                                         SUBPROTOCOL_KEY + key]))
    elif carrier.kind == "header":
        assert carrier.name is not None
        headers.set(carrier.name, key)
    elif carrier.kind == "bearer":
        headers.set("Authorization", f"Bearer {key}")
    elif carrier.kind == "token":
        headers.set("Authorization", f"token {key}")
    elif carrier.kind == "basic":
        raw = f"{carrier.name or ''}:{key}".encode()
        headers.set("Authorization", "Basic " + base64.b64encode(raw).decode())
    elif carrier.kind == "query":
        base, pairs = _query(path)
        pairs.append((carrier.name or "key", key))
        path = base + "?" + urlencode(pairs)
    return path


def find_token(headers: Headers, path: str) -> str | None:
    """A gateway token carried anywhere a provider key goes (headers, Basic, query):
    how a transparent connection from an unregistered source identifies itself."""
    candidates = [v for _, v in headers.items()] + [v for _, v in _query(path)[1]]
    for value in candidates:
        if TOKEN_PREFIX not in value:
            scheme, _, param = value.strip().partition(" ")
            if scheme.lower() != "basic":
                continue
            try:
                value = base64.b64decode(param.strip(), validate=True).decode()
            except ValueError:  # binascii.Error, UnicodeDecodeError, non-ASCII input
                continue
            if TOKEN_PREFIX not in value:
                continue
            value = value.partition(":")[2]
        for part in value.replace(",", " ").split():
            at = part.find(TOKEN_PREFIX)  # (after a credential's placeholder prefix, if any)
            if at >= 0:
                return part[at:]
    return None
