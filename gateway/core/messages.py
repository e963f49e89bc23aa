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


_KEYS: dict[str, bytes] = {}  # a looked-up name -> its lower-case bytes (names are few)


def _key(name: str) -> bytes:
    key = _KEYS.get(name)
    if key is None:
        key = name.lower().encode("latin-1")
        if len(_KEYS) < 512:
            _KEYS[name] = key
    return key


class Headers:
    """An ordered multi-map of header fields (case-insensitive names, repeated fields kept).

    `fields` is replaced, never changed in place: the lower-case name index that
    lookups use is built on the first lookup after each replacement.
    """

    __slots__ = ("_fields", "_index")

    def __init__(self, fields: Iterable[tuple[bytes, bytes]] = ()) -> None:
        self._fields: list[tuple[bytes, bytes]] = list(fields)
        self._index: dict[bytes, list[int]] | None = None

    @property
    def fields(self) -> list[tuple[bytes, bytes]]:
        return self._fields

    @fields.setter
    def fields(self, fields: list[tuple[bytes, bytes]]) -> None:
        self._fields = fields
        self._index = None

    def _built(self) -> dict[bytes, list[int]]:
        """The lower-case name index (built on the first lookup after `fields` changed)."""
        index = self._index
        if index is None:
            index = self._index = {}
            for i, (k, _) in enumerate(self._fields):
                key = k.lower()
                positions = index.get(key)
                if positions is None:
                    index[key] = [i]
                else:
                    positions.append(i)
        return index

    def _positions(self, name: str) -> list[int] | None:
        index = self._index
        if index is None:
            index = self._built()
        key = _KEYS.get(name)  # (the usual case, without a call: ~25 lookups a request)
        return index.get(key if key is not None else _key(name))

    @classmethod
    def of(cls, *pairs: tuple[str, str]) -> Headers:
        """Headers from text pairs (for answers the gateway makes itself)."""
        return cls((k.encode("latin-1"), v.encode("latin-1")) for k, v in pairs)

    def get(self, name: str) -> str | None:
        """The first value of `name`, or None."""
        positions = self._positions(name)
        return self._fields[positions[0]][1].decode("latin-1") if positions else None

    def joined(self, name: str) -> str | None:
        """A list-based field's value, every line of it (RFC 9110 5.3: its field lines are
        one comma-separated list, and a receiver reads them all: `Content-Encoding`), or
        None."""
        positions = self._positions(name)
        if not positions:
            return None
        fields = self._fields
        return ", ".join(fields[i][1].decode("latin-1") for i in positions)

    def get_all(self, name: str) -> list[str]:
        """Every value of `name`, in order."""
        fields = self._fields
        return [fields[i][1].decode("latin-1") for i in self._positions(name) or ()]

    def count(self, name: str) -> int:
        return len(self._positions(name) or ())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and bool(self._positions(name))

    def set(self, name: str, value: str) -> None:
        """Replace every `name` field by one (at the first one's place, else at the end)."""
        positions = self._positions(name)
        raw = value.encode("latin-1")
        fields = list(self._fields)  # (a new list: a caller may hold the old one)
        if not positions:  # appended: the index stays right, with one more entry
            fields.append((name.encode("latin-1"), raw))
            self._fields = fields
            if self._index is not None:
                self._index[_key(name)] = [len(fields) - 1]
            return
        first = positions[0]
        fields[first] = (fields[first][0], raw)
        if len(positions) == 1:  # replaced in place: no position moved
            self._fields = fields
            return
        drop = set(positions[1:])
        self.fields = [f for i, f in enumerate(fields) if i not in drop]

    def remove(self, name: str) -> bool:
        """Drop every `name` field; True if there was one."""
        positions = self._positions(name)
        if not positions:
            return False
        drop = set(positions)
        self._fields = [f for i, f in enumerate(self._fields) if i not in drop]
        # The index follows (the usual removal is one field): the other names' positions
        # move down by the dropped fields before them, with no name lowered again.
        index = self._index
        assert index is not None  # (built by `_positions`)
        del index[_key(name)]
        first = positions[0]
        for key, at in index.items():
            if at[-1] > first:
                index[key] = [i - sum(1 for d in positions if d < i) for i in at] \
                    if len(positions) > 1 else [i - 1 if i > first else i for i in at]
        return True

    def without(self, names: Iterable[bytes]) -> list[tuple[bytes, bytes]]:
        """The fields but those named by `names` (lower-case bytes), in order."""
        index = self._built()
        drop = {i for name in names for i in index.get(name, ())}
        if not drop:
            return list(self._fields)
        return [f for i, f in enumerate(self._fields) if i not in drop]

    def items(self) -> Iterator[tuple[str, str]]:
        for k, v in self._fields:
            yield k.decode("latin-1"), v.decode("latin-1")

    def copy(self) -> Headers:
        return Headers(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        return f"Headers({[k.decode('latin-1') for k, _ in self._fields]})"  # names only


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
    # The engine's parser checked that every field name is a token (h11 does; it lets
    # some control characters through in values, which the core checks on every head).
    names_checked: bool = False


@dataclass(slots=True)
class ResponseHead:
    """A response head from the upstream (or made by the gateway)."""

    status: int
    reason: str
    headers: Headers
    http_version: str = "HTTP/1.1"
