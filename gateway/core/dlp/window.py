"""A streamed scan's window of bytes (pure): kept as its pieces came, joined only when
read, so that the bytes of a window let go unread are never copied."""

from __future__ import annotations

__all__ = ["Window"]


class Window:
    """The window's bytes (latin-1: a byte is a character of the decoded text), kept as
    the pieces came and joined only when read: the bytes of a window the shared pass
    lets go unread (most of a large upload) are never copied. Pieces under `SMALL` bytes
    are gathered in a buffer of its own (a stream of tiny pieces holds few objects); a
    piece is never changed (the caller forwards it: a bytearray from the TLS reader)."""

    __slots__ = ("_gather", "_parts", "_skip", "size")
    SMALL = 4096

    def __init__(self) -> None:
        self._parts: list[bytes | bytearray] = []
        self._gather = bytearray()  # (the small pieces' buffer, while it is the last part)
        self._skip = 0  # bytes at the start of the first part dropped already
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def add(self, piece: bytes) -> None:
        parts = self._parts
        if len(piece) >= self.SMALL:
            parts.append(piece)
        elif parts and parts[-1] is self._gather:
            self._gather += piece
        elif piece:
            self._gather = bytearray(piece)
            parts.append(self._gather)
        self.size += len(piece)

    def read(self) -> bytes | bytearray:
        """The window's bytes, in one object."""
        parts = self._parts
        if len(parts) == 1 and not self._skip:
            return parts[0]
        if not parts:
            return b""
        with memoryview(parts[0]) as first:
            joined = b"".join([first[self._skip:], *parts[1:]])
        self._parts, self._skip = [joined], 0
        return joined

    def drop(self, n: int) -> None:
        """Drop the first `n` bytes."""
        self.size -= n
        n += self._skip
        parts = self._parts
        whole = 0
        while whole < len(parts) and len(parts[whole]) <= n:
            n -= len(parts[whole])
            whole += 1
        del parts[:whole]
        self._skip = n
        if n and len(parts) == 1 and len(parts[0]) - n < n // 4:
            # (what is kept of a large piece, copied out: the piece, a bytearray from the
            # TLS reader, is let go now rather than at the next piece, and the reader's
            # next buffer reuses its memory while it is still in the cache)
            with memoryview(parts[0]) as rest:
                parts[0] = bytes(rest[n:])
            self._skip = 0
