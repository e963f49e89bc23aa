"""What a gateway process takes from the system at start (`runtime/startup.py`): its
listening sockets on real ports (a port another process serves is a start-up error
naming it; worker processes share theirs), its open-files limit, its descriptors."""

from __future__ import annotations

import asyncio
import os
import resource
import socket

import pytest

from gateway.config import HostPort
from gateway.runtime.startup import StartupError, bind, open_fds, raise_fd_limit


def test_a_port_served_by_another_socket_is_refused_naming_it() -> None:
    first = bind(HostPort("127.0.0.1", 0))
    try:
        port = first.getsockname()[1]
        with pytest.raises(StartupError, match=f"cannot listen on 127.0.0.1:{port}: .*"
                                               "is another gateway or program serving it"):
            bind(HostPort("127.0.0.1", port))
    finally:
        first.close()


def test_worker_processes_share_their_port() -> None:
    first = bind(HostPort("127.0.0.1", 0), shared=True)
    try:
        second = bind(HostPort("127.0.0.1", first.getsockname()[1]), shared=True)
        try:
            assert second.getsockname() == first.getsockname()
            assert not second.getblocking()
            assert second.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
        finally:
            second.close()
    finally:
        first.close()


def test_connections_on_a_listener_send_without_waiting_for_acks() -> None:
    """asyncio sets TCP_NODELAY on a server's connections only when the listening socket
    says it is TCP (IPPROTO_TCP): made without it, the admin API's and the proxy's
    answers written as a head and then a body waited 40 ms a request for the client's
    delayed ACK on a kept-alive connection (the console: 44 ms a page, 1 ms now)."""
    async def main() -> int:
        listener = bind(HostPort("127.0.0.1", 0))
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        try:
            _, writer = await asyncio.open_connection(*listener.getsockname())
            found = await asyncio.wait_for(accepted, 5)
            writer.close()
            await writer.wait_closed()
            return found
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) == 1


def test_an_ipv6_address_gets_an_ipv6_socket() -> None:
    try:
        sock = bind(HostPort("::1", 0))
    except StartupError:
        pytest.skip("no IPv6 loopback here")
    with sock:
        assert sock.family == socket.AF_INET6


def test_the_open_files_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        limit = raise_fd_limit()
        assert limit >= soft
        assert limit == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if hard != resource.RLIM_INFINITY:
            assert limit == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_open_descriptors_are_counted() -> None:
    before = open_fds()
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        assert open_fds() == before + 1
    finally:
        os.close(fd)
