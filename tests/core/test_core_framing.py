"""Which reader a body's messages are read by (`core/framing.py`), by its Content-Type."""

from __future__ import annotations

import pytest

from gateway.core.framing import is_framed, reader_for
from gateway.core.git_pack import PackReader
from gateway.core.grpc_frames import Frames, TextFrames


@pytest.mark.parametrize(("ctype", "reader"), [
    ("application/grpc", Frames), ("application/grpc-web+proto", Frames),
    ("application/connect+json", Frames), ("application/grpc-web-text", TextFrames),
    ("application/x-git-receive-pack-request", PackReader),
    ("application/x-git-upload-pack-request", None), ("application/json", None),
    ("multipart/form-data; boundary=x", None), (None, None)])
def test_a_body_is_read_by_the_reader_its_type_names(ctype: str | None,
                                                     reader: type | None) -> None:
    found = reader_for(ctype)
    assert (type(found) if found is not None else None) is reader
    assert is_framed(ctype) is (reader is not None)
    if found is not None:
        assert found.unit in ("gRPC message", "git object") and found.pending == 0
