"""Every zip entry a body holds, wherever its local header is, and a body's files (pure).

`unzip` and Python's `zipfile` find a zip's entries through its central directory at its
end, which may point anywhere: after other bytes (a self-extracting program, an image
that is also a zip: unzip warns of "extra bytes at beginning" and extracts), past junk
between entries, inside another entry's bytes; and they take an entry's method and sizes
from it, which need not be its local header's. A reader walking the local headers from
a body's first byte misses all of these. So every `PK\\3\\4` in a body's bytes (found by
one pass, `_gate.local_header`) starts an entry, and its data is read as what it decodes
as, whatever its header says (`entry_kinds`: raw deflate always, and bzip2, zstd, xz or
zip's LZMA where its first bytes are theirs), each to its stream's own end or to bytes
that stop decoding (what decoded before them is read). A stored entry's bytes are the
body's own, read as they are; an encrypted one's decode to nothing (what a cipher hides
no reading finds). The entries share one bound (`archives.Allowance`), and at most `LIVE`
decode at once (entries inside entries, beyond: refused); a new one is given the size
its header says (from `_FIRST` to `_STEP` bytes: most entries in one call), then twice
as many each time: the many a crafted body may start die cheaply, and what a stream
that ends leaves of its piece (copied by its decoder) is at most what it read. A body's
bytes cut anywhere give the same entries.

`Sniffed` reads a streamed body's files: the compressed file its first bytes say it is
(`archives.archive_kind`), and its zip entries.
"""

from __future__ import annotations

from typing import Protocol

from gateway.core.archives import FIRST_BYTES, Allowance, Unpacker, archive_kind
from gateway.core.encodings import EncodingError
from gateway.core.unpack_bounds import AMPLE, charged_to, spend

__all__ = ["LIVE", "NO_SIGNATURE", "Sniffed", "ZipEntries", "entry_kinds", "holds_files",
           "last_bytes", "local_header", "quiet", "unpacked_files"]

NO_SIGNATURE = 256  # (a bit beside `Gate.flags`' that `DlpCheck.passed` sets: no `PK\3\4`
# in the piece, searched once for the leak guard's files and detection's)
LIVE = 8  # entries decoding at once, at most (a zip's are one after another: 1 or 2)
_FIRST = 512  # bytes a new entry is given first at least: data that is no stream fails
_STEP = 4096  # in them; at most (its header's size, if it says one, up to this: one call)
_SIGNATURE = b"PK\x03\x04"
_HEAD = 30  # a local header's fixed bytes; its name and extra field follow
_SNIFF = 6  # bytes of an entry's data that say what it is (xz's magic is the longest)
# (bytes an entry's stream that decodes to nothing is charged as, past `AMPLE` times the
# body's bytes, to its sandbox's unpacking budget: a body of nothing but local headers
# costs ~15 µs each, 0.6 s a MiB; a zip's stored entries are tried as deflate too, and
# charged only where they are smaller than about 150 bytes each)
_TRIED = 4096


class _Find(Protocol):
    def __call__(self, data: bytes | memoryview, start: int = 0, /) -> int: ...


def local_header(data: bytes | memoryview, start: int = 0) -> int:
    """The first offset at `start` or after of a zip's local header's signature in
    `data`, or -1: `_gate.local_header` in C where it is built (16 µs a MiB), else
    `bytes.find` (0.5-0.9 ms)."""
    return _SEARCH[0](data, start)


def _bound(data: bytes | memoryview, start: int = 0) -> int:
    """The first call: which search there is, bound for the next (imported here, not at
    the top: importing the C module imports gateway.core.dlp, whose scanners import this
    module, and an import cycle's ImportError read as "not built" made every search
    `bytes.find`'s, whichever module a process imported first)."""
    try:
        from gateway.core.dlp import _gate

        _SEARCH[0] = _gate.local_header
    except ImportError:  # (not built)
        _SEARCH[0] = _find_bytes
    return _SEARCH[0](data, start)


def _find_bytes(data: bytes | memoryview, start: int = 0) -> int:
    return bytes(data).find(_SIGNATURE, start)


_SEARCH: list[_Find] = [_bound]


def entry_kinds(data: bytes) -> tuple[str, ...]:
    """The streams an entry's data (its first `_SNIFF` bytes) is read as: deflate, and
    the compressed file or zip LZMA (its 2-byte version, then `05 00`) it starts as."""
    kind = archive_kind(data)
    if kind is not None and kind != "zip":
        return ("deflate", kind)
    return ("deflate", "lzma") if data[2:4] == b"\x05\x00" else ("deflate",)


class ZipEntries:
    """Feed a body's bytes (`feed`, the last with `final`): the bytes of every zip entry
    in them, each by a number of its own from 1 (`names`: its local header's file name;
    an entry read as two streams has two), a piece for each of its decoder's calls (a
    reader's scan of a piece is cheaper than of a feed's pieces joined).
    `live`: the numbers still decoding. Bounded by `allowance` (or its own bytes').
    `slots`: each entry's bytes by the lowest number no live entry has instead (entries
    one after another share 1: a reader of a body's files makes a scanner a number, not
    one for each of a zip's 100,000 files; names are then of no use)."""

    __slots__ = ("_allowance", "_charged", "_count", "_grow", "_heads", "_keys", "_live",
                 "_seen", "_slots", "_tail", "_tried", "names")

    def __init__(self, allowance: Allowance | None = None, slots: bool = False) -> None:
        self._slots = slots
        self._keys: dict[int, int] = {}  # (a live entry's number: the number it gives by)
        self._grow = allowance is None
        self._allowance = Allowance(0) if allowance is None else allowance
        self._tail = b""  # (the last bytes: a signature cut by a piece's end)
        self._heads: list[bytearray] = []  # (local headers begun, not whole yet)
        self._live: dict[int, Unpacker] = {}
        self._count = 0
        self._seen = self._tried = self._charged = 0  # (bytes fed; streams that gave
        self.names: dict[int, str] = {}  # nothing; what they were charged)

    @property
    def live(self) -> bool:
        """Whether an entry is decoding (a header being read gives no bytes yet)."""
        return bool(self._live)

    @property
    def heads(self) -> bool:
        """Whether a local header is begun, not whole yet."""
        return bool(self._heads)

    def numbers(self) -> frozenset[int]:
        """The numbers of the entries still decoding."""
        return frozenset(self._keys[number] for number in self._live)

    def after(self, tail: bytes) -> None:
        """Begun after bytes that held no signature, ending with `tail` (3 at most)."""
        self._tail = tail[-3:]

    def skips(self, data: bytes, searched: bool = False) -> bool:
        """`feed` for `data` that adds nothing (no entry or header being read, no
        signature in it or across its cut; `searched`: the caller found none in it):
        True, its bytes taken; False, having done nothing, for any other (most pieces of
        most bodies: one search)."""
        if self._live or self._heads or (not searched and local_header(data) >= 0):
            return False
        tail = self._tail
        if _across(tail, data) >= 0:
            return False
        if self._grow:
            self._allowance.grow(len(data))
        self._seen += len(data)
        self._tail = last_bytes(tail, data)
        return True

    def feed(self, data: bytes, final: bool = False) -> list[tuple[int, bytes]]:
        """What `data` adds to the entries (raises EncodingError past the bound, or for
        more than `LIVE` entries decoding at once)."""
        if self._grow:
            self._allowance.grow(len(data))
        self._seen += len(data)
        out: list[tuple[int, bytes]] = []
        for number, unpacker in list(self._live.items()):
            self._give(number, unpacker, data, out)
        heads, self._heads = self._heads, []
        for head in heads:  # (headers begun in a piece before: their bytes from this one)
            self._begin(head, memoryview(data), 0, final, out)
        tail = self._tail
        if (at := _across(tail, data)) >= 0:  # (a signature across the pieces' cut)
            self._begin(bytearray(tail[at:]), memoryview(data), 0, final, out)
        at = local_header(data)
        while at >= 0:
            self._begin(bytearray(), memoryview(data), at, final, out)
            at = local_header(data, at + 1)
        self._tail = last_bytes(tail, data)
        return out

    def _begin(self, head: bytearray, data: memoryview, at: int, final: bool,
               out: list[tuple[int, bytes]]) -> None:
        """A local header whose first bytes are `head` and then `data[at:]`: its entry
        begun where `data` holds all of it and its data's first bytes, else kept."""
        have = len(head)
        need = _HEAD
        if have + len(data) - at >= _HEAD:
            first = bytes(head[:_HEAD]) if have >= _HEAD else bytes(head) + bytes(
                data[at:at + _HEAD - have])
            need += int.from_bytes(first[26:28], "little") + int.from_bytes(
                first[28:30], "little")
        take = need + _SNIFF - have  # (of `data`, from `at`)
        if len(data) - at < take and not final:
            head += data[at:]
            self._heads.append(head)  # (the rest with the next piece)
            self._check()
            return
        whole = bytes(head) + bytes(data[at:at + max(take, 0)])
        if len(whole) < need:
            return  # (the body ended in its header)
        name = whole[_HEAD + 0:need - int.from_bytes(whole[28:30], "little")]
        said = min(max(int.from_bytes(whole[18:22], "little"), _FIRST), _STEP)
        start = at + max(need - have, 0)  # (where its data begins in `data`)
        rest = data[start:] if have <= need else memoryview(bytes(head[need:]) + bytes(
            data[at:]))
        for kind in entry_kinds(bytes(rest[:_SNIFF])):
            self._count += 1
            number = self._count
            if self._slots:
                taken = self.numbers()
                self._keys[number] = next(key for key in range(1, LIVE + 3) if key not in taken)
            else:
                self._keys[number] = number
                self.names[number] = name.decode("utf-8", "replace")
            unpacker = Unpacker(kind, self._allowance)
            at, step, before = 0, said, len(out)  # (steps doubling: what a stream
            while at < len(rest) and not unpacker.done:  # ending early leaves, copied by
                self._give(number, unpacker, rest[at:at + step], out)  # its decoder, is at
                at, step = at + step, step * 2  # most what it read)
            if unpacker.done and len(out) == before:
                self._tried += 1  # (a stream that gave nothing: its cost charged)
                over = _TRIED * self._tried - AMPLE * self._seen - self._charged
                if over > 0 and charged_to() is not None:
                    self._charged += over
                    spend(over)

    def _give(self, number: int, unpacker: Unpacker, data: bytes | memoryview,
              out: list[tuple[int, bytes]]) -> None:
        """`data` to one entry's stream; what it gives to `out`."""
        key = self._keys[number]
        out += ((key, piece) for _, piece in unpacker.feed(data))
        if unpacker.done:
            self._live.pop(number, None)
            del self._keys[number]
        else:
            self._live[number] = unpacker
            self._check()

    def _check(self) -> None:
        if len(self._live) + len(self._heads) > LIVE:
            raise EncodingError(
                f"a zip with more than {LIVE} entries inside one another; send its files "
                "in a zip of their own")


def quiet(data: bytes, tail: bytes, seen: int, searched: bool = False) -> bool:
    """Whether `data`, after `seen` bytes of a body that held nothing ending with `tail`,
    holds nothing either: the body's first bytes (6 at least) no compressed file's, no
    zip signature in it (`searched`: the caller found none) or across the cut. A reader
    of a body's files need not be made for it (most bodies: one piece)."""
    if not seen and (len(data) < _SNIFF or data[0] in FIRST_BYTES):
        return False
    if not searched and local_header(data) >= 0:
        return False
    return _across(tail, data) < 0


def last_bytes(tail: bytes, data: bytes) -> bytes:
    """The last 3 bytes of what ended with `tail` and goes on with `data`: where a
    signature the next piece ends may begin."""
    return data[-3:] if len(data) >= 3 else (tail + data)[-3:]


def _across(tail: bytes, data: bytes) -> int:
    """Where in `tail` (a piece's last bytes) a signature `data` ends begins, or -1."""
    at = (tail + data[:3]).find(_SIGNATURE) if tail else -1
    return at if at < len(tail) else -1


def holds_files(body: bytes) -> bool:
    """Whether a body (not empty) is, or holds, something to unpack: a compressed file
    by its first bytes, or a zip's local header anywhere."""
    return (body[0] in FIRST_BYTES and archive_kind(body[:6]) not in (None, "zip")) or \
        local_header(body) >= 0


def unpacked_files(body: bytes, allowance: Allowance | None = None
                   ) -> list[tuple[str, bytes]]:
    """The files of a whole body, each named (`gzip file`, `zip entry .env`); raises
    EncodingError past the bound."""
    sniffed = Sniffed(allowance)
    joined: dict[int, list[bytes]] = {}
    for number, piece in sniffed.feed(body, final=True):
        joined.setdefault(number, []).append(piece)
    return [(sniffed.name(number), b"".join(data)) for number, data in joined.items()]


class Sniffed:
    """A body's files as it comes (`feed`): the compressed file its first bytes say it
    is (number 0), and the zip entries in it (numbers from 1; `slots`: as
    `ZipEntries`'). `live`: the numbers still being read."""

    __slots__ = ("_allowance", "_grow", "_head", "_kind", "_unpacker", "_zip", "decided")

    def __init__(self, allowance: Allowance | None = None, slots: bool = False,
                 after: tuple[bytes, int] | None = None) -> None:
        """`after`: the body's bytes so far held nothing (`quiet`): their last 3 and
        their size."""
        self._grow = allowance is None  # (its own bound: grown by its bytes, one for all)
        self._allowance = Allowance(0) if allowance is None else allowance
        self._head = b""  # (the first bytes, while fewer than a magic's)
        self.decided = False
        self._kind = ""
        self._unpacker: Unpacker | None = None
        self._zip = ZipEntries(self._allowance, slots)
        if after is not None:
            self.decided = True
            self._zip.after(after[0])
            if self._grow:
                self._allowance.grow(after[1])

    @property
    def idle(self) -> bool:
        """Whether no bytes, nor the body's end, can give anything yet (its first bytes
        read, no file being read, no zip header begun)."""
        return self.decided and not self.reading and not self._zip.heads

    def name(self, number: int) -> str:
        """What a number's file is called (`gzip file`, `zip entry .env`)."""
        return f"{self._kind} file" if not number else \
            f"zip entry {self._zip.names.get(number, '')}"

    def live(self) -> frozenset[int]:
        """The files still being read."""
        live = self._zip.numbers()
        reading = not self.decided or (self._unpacker is not None and not self._unpacker.done)
        return live | {0} if reading else live

    @property
    def reading(self) -> bool:
        """Whether a file is being read, whose bytes may give more (not the first bytes
        being sniffed, nor a zip's header: they give none)."""
        return self._zip.live or (self._unpacker is not None and not self._unpacker.done)

    def skips(self, data: bytes, searched: bool = False) -> bool:
        """`feed` for `data` that adds nothing (its first bytes read, no compressed file
        being unpacked, nothing for the zip's entries: `ZipEntries.skips`): True, its
        bytes taken; False, having done nothing, for any other."""
        if not self.decided:  # (a first piece whose first byte says no compressed file:
            if self._head or len(data) < _SNIFF or data[0] in FIRST_BYTES or \
                    not self._zip.skips(data, searched):  # decided here; most bodies)
                return False
            self.decided = True
        elif (self._unpacker is not None and not self._unpacker.done) or \
                not self._zip.skips(data, searched):
            return False
        if self._grow:
            self._allowance.grow(len(data))
        return True

    def feed(self, data: bytes, final: bool = False) -> list[tuple[int, bytes]]:
        """What `data` adds to the body's files (raises EncodingError past the bound)."""
        if self._grow:
            self._allowance.grow(len(data))
        out = self._zip.feed(data, final) if data or final else []
        if self.decided:
            if self._unpacker is not None and data and not self._unpacker.done:
                out[:0] = [(0, piece) for _, piece in self._unpacker.feed(data)]
            return out
        head = self._head + data if self._head else data  # (no copy of a first piece)
        if len(head) < _SNIFF and not final:
            self._head = head
            return out
        self.decided, self._head = True, b""
        kind = archive_kind(head[:_SNIFF])
        if kind is None or kind == "zip":
            return out
        self._kind = kind
        self._unpacker = Unpacker(kind, self._allowance)
        return [(0, piece) for _, piece in self._unpacker.feed(head)] + out
