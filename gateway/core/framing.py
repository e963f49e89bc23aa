"""Which reader a body's messages are read by (pure), by its Content-Type: a gRPC,
gRPC-Web or Connect streaming body's messages (`grpc_frames`), a git push's ref updates
and objects (`git_pack`). What such a body holds is in its messages, compressed or
deflated where the body's bytes do not show it; the leak guard and outbound credential
detection read them through one interface (`MessageReader`)."""

from __future__ import annotations

import functools
from typing import Protocol

from gateway.core.git_pack import PackReader, is_git_push
from gateway.core.grpc_frames import frames_for, is_grpc

__all__ = ["MessageReader", "framing", "is_framed", "reader_for"]


class MessageReader(Protocol):
    """A body's messages, fed as it comes: the bytes of each, numbered (raises
    `EncodingError` for a body it cannot read)."""

    unit: str  # (what a message is called: `gRPC message`, `git object`)

    @property
    def pending(self) -> int: ...  # (bytes taken in and not given out yet)

    def feed(self, data: bytes) -> list[bytes]: ...

    def numbered(self, data: bytes) -> list[tuple[int, int, bytes]]: ...

    def end(self) -> None: ...


@functools.lru_cache(maxsize=256)  # (asked for every view of every body: a few types)
def is_framed(content_type: str | None) -> bool:
    """Whether a body of this Content-Type is read by its messages."""
    return is_grpc(content_type) or is_git_push(content_type)


def reader_for(content_type: str | None) -> MessageReader | None:
    """A reader of a body of this Content-Type's messages, None for a body read as
    it is."""
    made = framing(content_type)
    return made() if made is not None else None


@functools.lru_cache(maxsize=256)  # (asked for every request with a body: a few types)
def framing(content_type: str | None) -> type[MessageReader] | None:
    """The class of `reader_for`'s reader (None: none): two types that name different
    ones are two readings of one body."""
    if is_git_push(content_type):
        return PackReader
    found = frames_for(content_type)
    return type(found) if found is not None else None
