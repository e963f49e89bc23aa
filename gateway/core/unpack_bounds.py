"""What unpacking may cost, beyond one body's bound (`archives.Allowance`) (pure): one
sandbox's `Excess` across its requests, and which of a stream's bytes may go on while
what they unpack to is read (`Undecided`)."""

from __future__ import annotations

from collections import deque

from gateway.core.encodings import EncodingError

__all__ = ["AMPLE", "Excess", "ExcessError", "Undecided", "charge_to", "charged_to", "spend"]

AMPLE = 16  # times its compressed bytes a file unpacks to before its sandbox is charged


class Excess:
    """What one sandbox's compressed data may still unpack to beyond `AMPLE` times its
    own bytes (`left`), across its requests: a body of bombs costs a worker's CPU many
    times what it costs to send (an 80 KB request unpacking to 60 MiB: half a second),
    and a sandbox's connections (256 by default) could keep a worker busy with them. The
    pipeline refills it as time passes and sets the one of the request in hand
    (`EXCESS`: `pipeline/unpacking.py`); ordinary archives (text packs 3 to 10 times)
    are never charged."""

    __slots__ = ("left", "rate", "size")

    def __init__(self, size: float, rate: float) -> None:
        self.left = self.size = size  # (bytes; at most `size`)
        self.rate = rate  # (bytes a second it is refilled with: said in the refusal)


_charged: Excess | None = None  # (the Excess of the request being read)


def charge_to(excess: Excess | None) -> None:
    """What is unpacked from now on is charged to `excess` (None: to no sandbox's). The
    exchange in hand says so at each of its calls that read the request, and None when
    it ends; requests are read on the gateway's one event-loop thread (mitmproxy's
    hooks too, in tasks of their own: said at each call, not once a connection). A
    module's name, not a ContextVar (set and reset around each call, those cost the
    intercepted request 2 % of its instructions) nor a thread-local (the core imports
    no threading)."""
    global _charged
    _charged = excess


def charged_to() -> Excess | None:
    """The `Excess` what is unpacked now is charged to."""
    return _charged


class ExcessError(EncodingError):
    """A sandbox's `Excess` spent: its compressed data is refused until it refills."""


def spend(amount: int) -> None:
    """`amount` bytes more past `AMPLE` times their bytes, to the `Excess` in hand (if
    any); raises ExcessError once it is spent."""
    excess = _charged
    if excess is None or amount <= 0:
        return
    excess.left -= amount
    if excess.left < 0:
        raise ExcessError(
            f"this sandbox's compressed data unpacked to more than {AMPLE} times its size "
            f"by over {excess.size / 2**20:.0f} MiB lately (refilled at "
            f"{excess.rate / 2**20:.0f} MiB a second); send it uncompressed, or slower")


class Undecided:
    """Which of a stream's bytes may go on while what they unpack to is read: a caller
    that forwards the stream holds back the last `held(decided)` bytes, `decided` the
    bytes of the files it has read (a value starting before it is found or not there).

    A piece's bytes may hold bits the unpacker decodes only with the next bytes (a
    deflate symbol across pieces; a bzip2 block gives its bytes at its end), so the
    bytes up to a piece that gave any go once the files' bytes of the next piece that
    gave any are decided; bytes that give nothing (a deflate stream of empty blocks) are
    held until such a piece. `settle`: what was fed gives nothing more (a part that is
    no archive, an archive's end)."""

    __slots__ = ("_last", "_marks", "_released", "out", "raw")

    def __init__(self) -> None:
        self._marks: deque[tuple[int, int]] = deque()  # (bytes that may go, once `out`
        self._last = 0  # bytes up to the last piece that gave any     is decided)
        self._released = 0
        self.raw = 0  # bytes fed
        self.out = 0  # bytes the files gave

    def fed(self, raw: int, gave: int) -> None:
        """`raw` more bytes fed, which gave `gave` bytes of files."""
        self.raw += raw
        if gave:
            self.out += gave
            self._marks.append((self._last, self.out))
            self._last = self.raw

    def passed(self, raw: int) -> None:
        """`raw` more bytes fed, with no file being read: `fed` and `settle` at once (they
        go once what came before is decided; at once where nothing is pending)."""
        if self._marks:
            self.fed(raw, 0)
            self.settle()
        else:
            self.raw += raw
            self._released = self._last = self.raw

    def settle(self) -> None:
        """What was fed gives nothing more: it goes once what it gave is decided."""
        marks = self._marks
        if marks and marks[-1][1] == self.out:
            marks[-1] = (self.raw, self.out)
        else:
            marks.append((self.raw, self.out))
        self._last = self.raw

    def held(self, decided: int) -> int:
        """The last bytes fed not to go on yet, the files' first `decided` bytes read."""
        marks = self._marks
        while marks and marks[0][1] <= decided:
            self._released = max(self._released, marks.popleft()[0])
        return self.raw - self._released
