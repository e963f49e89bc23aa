"""An asyncio socket transport collected unclosed warns with where it was made
(tests/helpers/transports.py, applied to the whole suite by tests/conftest.py)."""

from __future__ import annotations

import asyncio
import gc
import socket
import warnings

import pytest


async def _leak(port: int) -> None:
    """Open a connection and drop it unclosed (what a leaking owner does)."""
    await asyncio.get_running_loop().create_connection(asyncio.Protocol, "127.0.0.1", port)


def test_an_unclosed_transport_names_its_maker() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server, \
            warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(_leak(server.getsockname()[1]))
        finally:
            loop.close()
        gc.collect()
        accepted, _ = server.accept()
        accepted.close()
    said = [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)]
    transport = [m for m in said if m.startswith("unclosed transport")]
    assert transport, said
    assert "made at" in transport[0] and "in _leak" in transport[0], transport[0]
    assert __file__ in transport[0]


def test_a_closed_transport_says_nothing() -> None:
    async def closed(port: int) -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
        await writer.wait_closed()

    with socket.create_server(("127.0.0.1", 0)) as server, \
            warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        asyncio.run(closed(server.getsockname()[1]))
        gc.collect()
        accepted, _ = server.accept()
        accepted.close()
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)]


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
