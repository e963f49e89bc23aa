"""What a gateway process takes from the system at start (`runtime/startup.py`): its
listening sockets on real ports (a port another process serves is a start-up error
naming it; worker processes share theirs), its open-files limit, its descriptors."""

from __future__ import annotations

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
