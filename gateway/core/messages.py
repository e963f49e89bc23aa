"""Engine-neutral HTTP message heads: what an engine hands the core and gets back.

Every engine (the HTTP/1 engine, the mitmproxy adapter) translates its native request
and response heads into these, calls the core, and applies what comes back. Header
fields are kept as raw `(name, value)` byte pairs in wire order with the name's case
as sent; lookups ignore case. Values are exchanged as latin-1 text (a lossless view of
the bytes), so nothing is lost or re-encoded on the way through.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

__all__ = ["Headers", "RequestHead", "ResponseHead"]


class Headers:
    """An ordered multi-map of header fields (case-insensitive names, repeated fields kept)."""

    __slots__ = ("fields",)

    def __init__(self, fields: Iterable[tuple[bytes, bytes]] = ()) -> None:
        self.fields: list[tuple[bytes, bytes]] = list(fields)

    @classmethod
    def of(cls, *pairs: tuple[str, str]) -> Headers:
        """Headers from text pairs (for answers the gateway makes itself)."""
        return cls((k.encode("latin-1"), v.encode("latin-1")) for k, v in pairs)

    def get(self, name: str) -> str | None:
        """The first value of `name`, or None."""
        key = name.lower().encode("latin-1")
        for k, v in self.fields:
            if k.lower() == key:
                return v.decode("latin-1")
        return None

    def get_all(self, name: str) -> list[str]:
        """Every value of `name`, in order."""
        key = name.lower().encode("latin-1")
        return [v.decode("latin-1") for k, v in self.fields if k.lower() == key]

    def count(self, name: str) -> int:
        key = name.lower().encode("latin-1")
        return sum(1 for k, _ in self.fields if k.lower() == key)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def set(self, name: str, value: str) -> None:
        """Replace every `name` field by one (at the first one's place, else at the end)."""
        key = name.lower().encode("latin-1")
        field = (name.encode("latin-1"), value.encode("latin-1"))
        out: list[tuple[bytes, bytes]] = []
        placed = False
        for k, v in self.fields:
            if k.lower() == key:
                if not placed:
                    out.append((k, field[1]))
                    placed = True
            else:
                out.append((k, v))
        if not placed:
            out.append(field)
        self.fields = out

    def remove(self, name: str) -> bool:
        """Drop every `name` field; True if there was one."""
        key = name.lower().encode("latin-1")
        kept = [(k, v) for k, v in self.fields if k.lower() != key]
        removed = len(kept) != len(self.fields)
        self.fields = kept
        return removed

    def items(self) -> Iterator[tuple[str, str]]:
        for k, v in self.fields:
            yield k.decode("latin-1"), v.decode("latin-1")

    def copy(self) -> Headers:
        return Headers(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    def __repr__(self) -> str:
        return f"Headers({[k.decode('latin-1') for k, _ in self.fields]})"  # names only


@dataclass(slots=True)
class RequestHead:
    """A request as the engine received it.

    `target` is the request-target as sent (origin-form `/p?q`, absolute-form
    `http://h/p`, or `*`); `authority` and `scheme` are HTTP/2's pseudo-headers (None
    on HTTP/1). `http_version` is `HTTP/1.0`, `HTTP/1.1` or `HTTP/2.0`.
    """

    method: str
    target: str
    headers: Headers
    http_version: str = "HTTP/1.1"
    authority: str | None = None
    scheme: str | None = None


@dataclass(slots=True)
class ResponseHead:
    """A response head from the upstream (or made by the gateway)."""

    status: int
    reason: str
    headers: Headers
    http_version: str = "HTTP/1.1"
