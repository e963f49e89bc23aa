"""The leak guard over a stream of chunks (pure): a marker split across two chunks is
still found, and a compressed file in a base64 or hex run of any length is read as it
streams (`streamed_runs.FollowedRun`).

Each chunk is searched with the tail of the chunks before it (`LeakScan.keep` bytes): the
window. `feed(chunk, run=...)` takes the answer of a pass over the stream made for another
check too (`fastscan.ChunkPass`, outbound credential detection's on a streamed body: one
pass serving both): whether a run of `SEGMENT` base64 characters ends in the chunk; a
stream fed without one makes its own (the run alone), from its first chunk. Where
every marker is such a run (`Markers.marker_runs`) and neither the window nor the one
before holds an escape, a window in which no run ends in the chunk holds no marker the
window before did not (searched, clean): a marker ending in the chunk is a run ending
there, one in the tail was in the window before, read the same. Such a window is not
made, nor searched; any other is, as without the answer.

A compressed file's run the window ends in (`streamed_runs.open_run`) is followed from
its start: its files are read by a scan of their own (markers, no deeper), the run's
bytes held back (`held_back`) until what they unpack to is read. What runs unpack to has
one bound (`allowance`), grown as the stream comes; an archive's files share their
body's, not grown by what they unpack to.
"""

from __future__ import annotations

from typing import Protocol

from gateway.core.archives import Allowance
from gateway.core.dlp.fastscan import BACKSLASH, ESCAPES_KNOWN, PERCENT, RUN, ChunkPass, Gate
from gateway.core.encodings import EncodingError
from gateway.core.streamed_runs import HELD, FollowedRun, open_run
from gateway.core.unpack_bounds import ExcessError

__all__ = ["Markers", "StreamScan", "plain"]

_RUNS = Gate()  # (a stream's own pass: the run alone)
_SINCE = 64  # bytes at the tail's end a run's start is looked for in again (its first
# characters cut by a chunk's end; a window that no run ends in is not searched)


class Markers(Protocol):
    """What a stream scan asks of one request's markers (`leaks.LeakScan`)."""

    keep: int  # (bytes of a window kept for the next: a marker's longest form)
    marker_runs: bool  # (every marker is a run of the base64 alphabets)

    def find(self, data: bytes, gate: Gate | None = None, allowance: Allowance | None = None,
             deeper: bool = True, run: bool = False) -> str | None: ...


def plain(data: bytes, flags: int = 0) -> bool:
    """Whether `data` holds no escape `canonical` undoes (it reads as itself lowercased):
    as the C pass's `flags` say where they know (`ESCAPES_KNOWN`), else by `find` (not
    `in`: CPython 3.12's tries the needle as an integer first: 0.45 µs a test)."""
    if flags & ESCAPES_KNOWN:
        return not flags & PERCENT and (not flags & BACKSLASH or _no_json_escape(data))
    return data.find(b"%") < 0 and (data.find(b"\\") < 0 or _no_json_escape(data))


def _no_json_escape(data: bytes) -> bool:
    return data.find(b"\\u00") < 0 and data.find(b"\\/") < 0  # (`data` holds a backslash)


class StreamScan:
    """Scans a stream of chunks (`feed`, then `end`); see the module docstring."""

    __slots__ = ("_deeper", "_files", "_follow", "_grows", "_pass", "_plain",
                 "_scan", "_tail", "allowance")

    def __init__(self, scan: Markers, allowance: Allowance | None = None,
                 deeper: bool = True) -> None:
        """`deeper`: base64 lines and compressed runs read too (not in a followed run's
        files: one level)."""
        self._scan, self._tail, self._deeper = scan, b"", deeper
        self.allowance, self._grows = allowance or Allowance(0), allowance is None
        self._plain = True  # (the window before holds no escape: none yet)
        self._follow: FollowedRun | None = None  # (a compressed run going on)
        self._files: dict[int, StreamScan] = {}  # (its files being read, by number)
        # (its own pass where it is fed no answer: made at the first chunk, dropped for
        # good at a chunk fed with one, whose seam it did not see; False: none)
        self._pass: ChunkPass | bool | None = None

    @property
    def held_back(self) -> int:
        """Bytes at the stream's end a followed run holds (not to go on yet)."""
        follow = self._follow
        if follow is None:
            return 0
        return follow.held(follow.out - sum(len(scan._tail) for scan in self._files.values()))

    @property
    def pending(self) -> int:
        """Bytes at the end of what it was fed not decided yet (a marker may start in
        them): the window's tail, or a followed run's bytes held."""
        return max(len(self._tail), self.held_back)

    def feed(self, chunk: bytes, gate: Gate | None = None, run: bool | None = None,
             flags: int = 0) -> str | None:
        """`token`, `secret` or None for the window ending with `chunk` (`run`: whether
        a run ends in `chunk`, None if not known, `flags` the C pass's for it if any;
        see the module docstring); `unreadable` past the bound."""
        tail, scan = self._tail, self._scan
        keep = scan.keep
        self.allowance.grow(len(chunk) if self._grows else 0)
        if self._pass is not False and scan.marker_runs:
            run, flags = self._passed(chunk, gate, run, flags)
        if self._follow is not None and (found := self._followed(chunk)) is not None:
            return found
        if run is False and self._plain and scan.marker_runs and plain(chunk, flags) \
                and (not tail or plain(tail[-3:] + chunk[:3])) \
                and chunk.find(b"\x00") < 0:  # (a NUL: UTF-16 text, read by `find`)
            self._tail = chunk[-keep:] if len(chunk) >= keep else (tail + chunk)[-keep:]
            return None
        window = tail + chunk if tail else chunk
        self._plain = run is not None and plain(window)  # (unknown: not asked)
        found = scan.find(window, gate, self.allowance, self._deeper, run is True)
        self._tail = window[-keep:] if len(window) > keep else window
        if found is None and self._follow is None and self._deeper:
            # (a compressed run going on: followed from its start; one that started
            # before the tail's last bytes was looked for in the window before)
            start = open_run(window, max(0, len(tail) - _SINCE))
            if start is not None:
                self._follow = FollowedRun(self.allowance)
                found = self._followed(window[start:])
        return found

    def _passed(self, chunk: bytes, gate: Gate | None, run: bool | None,
                flags: int) -> tuple[bool | None, int]:
        """`run` and `flags` as fed, or its own pass's (the run alone: a window that no
        run ends in is then not made, as where detection's pass answers; 4 MiB streamed
        without detection copied each chunk into a window, 8 % of its instructions)."""
        if run is not None or gate is not None:
            self._pass = False  # (an answer, or a gate to share: its own pass is not made)
            return run, flags
        made = self._pass
        if made is None:
            made = self._pass = ChunkPass(_RUNS)
        assert isinstance(made, ChunkPass)
        flags = made.flags(chunk, escapes=True)
        return bool(flags & RUN), flags

    def end(self) -> str | None:
        """The stream's end: a followed run's last characters read."""
        return self._followed(b"", final=True) if self._follow is not None else None

    def _followed(self, data: bytes, final: bool = False) -> str | None:
        """The followed run's next bytes (in `data`): its files' bytes read, each file by
        a scan of its own; the run let go where it ends; `unreadable` past the bound or
        where it holds back too much."""
        follow = self._follow
        assert follow is not None
        try:
            files = follow.end() if final else follow.feed(data)
        except ExcessError:  # (its sandbox's bucket spent: `unpack_bounds.Excess`)
            return "excess"
        except EncodingError:  # (past the bound: a bomb, refused as unreadable)
            return "unreadable"
        for number, _, piece in files:
            scan = self._files.get(number)
            if scan is None:
                scan = self._files[number] = StreamScan(self._scan, self.allowance, False)
            found = scan.feed(piece)
            if found is not None:
                return found
        live = follow.live()
        for number in [number for number in self._files if number not in live]:
            found = self._files.pop(number).end()  # (a file ended: read to its end)
            if found is not None:
                return found
        if follow.ended:
            self._follow = None
        elif self.held_back > HELD:
            return "unreadable"
        return None
