"""`SecretValue`: a secret string that refuses to show itself.

Every API key the gateway handles travels as a `SecretValue` so that an
accidental ``repr``, f-string, log call or pickle never prints or ships it.
The plain text is reachable only through `reveal()`, which makes every use
greppable. Comparisons run in constant time.
"""

from __future__ import annotations

import base64
import hmac
from typing import Any, ClassVar, NoReturn
from urllib.parse import quote, quote_plus

MASK = "SecretValue('****')"

# Below this many bytes a base64 fragment is too short to be a useful leak
# signature (it would match unrelated text).
_MIN_FRAGMENT_BYTES = 12


class SecretValue:
    """An immutable secret string with a masked repr and constant-time equality."""

    __slots__ = ("_raw", "_value", "_variants")
    # Unhashable on purpose: a hash derived from the value would be an oracle,
    # and a constant one would only invite using secrets as dict keys.
    __hash__: ClassVar[None]  # type: ignore[assignment]

    _value: str
    _raw: bytes
    _variants: tuple[bytes, ...]

    def __init__(self, value: str) -> None:
        if not isinstance(value, str):
            raise TypeError(f"SecretValue wraps a str, not {type(value).__name__}")
        if not value:
            # An empty secret would make every leak check match everything.
            raise ValueError("a secret value must not be empty")
        object.__setattr__(self, "_value", value)
        object.__setattr__(self, "_raw", value.encode("utf-8"))
        object.__setattr__(self, "_variants", encoding_variants(value))

    def reveal(self) -> str:
        """Return the plain secret. Call it only where the value must leave the process."""
        return self._value

    def variants(self) -> tuple[bytes, ...]:
        """Encodings of the value a leak detector must look for (computed once)."""
        return self._variants

    def pieces(self) -> tuple[str, ...]:
        """The strings of this value that can travel on the wire (each a leak marker)."""
        return (self._value,)

    def equals(self, other: str | bytes) -> bool:
        """Constant-time comparison with a plain str or bytes."""
        if isinstance(other, str):
            other = other.encode("utf-8")
        if not isinstance(other, bytes | bytearray):
            return False
        return hmac.compare_digest(self._raw, bytes(other))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SecretValue):
            return hmac.compare_digest(self._raw, other._raw)
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    def __repr__(self) -> str:
        return MASK

    def __str__(self) -> str:
        return MASK

    def __format__(self, format_spec: str) -> str:
        return MASK

    def __len__(self) -> int:
        return len(self._value)

    def __bool__(self) -> bool:
        return True

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise AttributeError("SecretValue is immutable")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError("SecretValue is immutable")

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError("SecretValue cannot be pickled (it would write the secret out)")

    def __reduce__(self) -> NoReturn:
        raise TypeError("SecretValue cannot be pickled (it would write the secret out)")

    def __getstate__(self) -> NoReturn:
        raise TypeError("SecretValue cannot be pickled (it would write the secret out)")

    def __copy__(self) -> SecretValue:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> SecretValue:
        return self


class MintedValue(SecretValue):
    """A value the gateway minted (an access token, an AWS key pair).

    ``lifetime``: seconds it stays valid from the moment it was minted (None: no known
    expiry); the secret cache keeps it until shortly before then. ``parts``: the
    strings of a composite value (access key id, secret key, session token) — each one
    is a leak marker and is redacted in responses, not the joined text.
    """

    __slots__ = ("_lifetime", "_parts")

    _lifetime: float | None
    _parts: tuple[str, ...]

    def __init__(self, value: str, *, lifetime: float | None = None,
                 parts: tuple[str, ...] = ()) -> None:
        super().__init__(value)
        kept = tuple(p for p in parts if p)
        object.__setattr__(self, "_lifetime", lifetime)
        object.__setattr__(self, "_parts", kept)
        if kept:
            variants = (v for p in kept for v in encoding_variants(p))
            object.__setattr__(self, "_variants", tuple(dict.fromkeys(variants)))

    @property
    def lifetime(self) -> float | None:
        return self._lifetime

    @property
    def parts(self) -> tuple[str, ...]:
        """The pieces of a composite value as given (empty for a single token)."""
        return self._parts

    def pieces(self) -> tuple[str, ...]:
        return self._parts or (self._value,)


def encoding_variants(value: str) -> tuple[bytes, ...]:
    """Raw, base64 (std/urlsafe, padded or not), URL-encoded, and base64 fragments.

    The fragments cover a secret embedded inside a longer base64 blob (for example
    ``Authorization: Basic base64("user:" + key)``) at each of the three byte
    alignments: they are the base64 of the whole 3-byte groups made only of
    secret bytes, which appear verbatim in any encoding of the surrounding data.
    """
    raw = value.encode("utf-8")
    found: list[bytes] = [raw]
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        padded = encode(raw)
        found += [padded, padded.rstrip(b"=")]
        for skip in (0, 1, 2):
            core = raw[skip:]
            core = core[: len(core) - len(core) % 3]
            if len(core) >= _MIN_FRAGMENT_BYTES:
                found.append(encode(core))
    found += [
        quote(value, safe="").encode("ascii"),
        quote(value).encode("ascii"),
        quote_plus(value).encode("ascii"),
    ]
    # Order-preserving de-duplication; the raw form stays first.
    return tuple(dict.fromkeys(found))
