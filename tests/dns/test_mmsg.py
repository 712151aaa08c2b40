"""recvmmsg/sendmmsg batches against the kernel: what arrives, from whom, and where replies go."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from istio_agent.dns.mmsg import DatagramBatch, address_tuple, data_address


def bound(family: socket.AddressFamily, host: str) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_DGRAM)
    sock.bind((host, 0))
    sock.setblocking(False)
    return sock


@pytest.fixture
def server() -> Iterator[socket.socket]:
    with bound(socket.AF_INET, "127.0.0.1") as sock:
        yield sock


def test_a_batch_reads_every_waiting_datagram_with_its_sender(server: socket.socket) -> None:
    clients = [bound(socket.AF_INET, "127.0.0.1") for _ in range(3)]
    try:
        for index, client in enumerate(clients):
            client.sendto(b"query %d" % index, server.getsockname())
        batch = DatagramBatch(size=8, datagram_size=64)
        assert batch.receive(server.fileno()) == 3
        assert [batch.datagram(i) for i in range(3)] == [b"query 0", b"query 1", b"query 2"]
        assert [batch.sender(i) for i in range(3)] == [client.getsockname() for client in clients]
        assert not any(batch.truncated(i) for i in range(3))
        assert batch.receive(server.fileno()) == 0  # nothing left: no blocking, no error
    finally:
        for client in clients:
            client.close()


def test_replies_go_to_each_sender_as_two_bytes_of_its_datagram_and_a_tail(server: socket.socket) -> None:
    clients = [bound(socket.AF_INET, "127.0.0.1") for _ in range(3)]
    tails = [b"-tail-%d" % index for index in range(3)]
    try:
        for index, client in enumerate(clients):
            client.sendto(b"I%d rest of query %d" % (index, index), server.getsockname())
        batch = DatagramBatch(size=8, datagram_size=64)
        assert batch.receive(server.fileno()) == 3
        known = {b" rest of query %d" % i: (tails[i], data_address(tails[i]), f"extra {i}") for i in (0, 2)}
        assert batch.reply_known(3, known) == (["extra 0", "extra 2"], [1])  # any subset
        assert batch.send(server.fileno()) == 2
        assert clients[0].recv(64) == b"I0-tail-0"
        assert clients[2].recv(64) == b"I2-tail-2"
        with pytest.raises(BlockingIOError):
            clients[1].recv(64)
        assert batch.send(server.fileno()) == 0  # the queue was emptied
    finally:
        for client in clients:
            client.close()


def test_more_waiting_than_a_batch_holds_is_read_over_several_batches(server: socket.socket) -> None:
    with bound(socket.AF_INET, "127.0.0.1") as client:
        for index in range(10):
            client.sendto(b"%d" % index, server.getsockname())
        batch = DatagramBatch(size=4, datagram_size=16)
        seen: list[bytes] = []
        while count := batch.receive(server.fileno()):
            seen += [batch.datagram(i) for i in range(count)]
        assert seen == [b"%d" % index for index in range(10)]


def test_a_datagram_longer_than_a_slot_arrives_cut_and_says_so(server: socket.socket) -> None:
    with bound(socket.AF_INET, "127.0.0.1") as client:
        client.sendto(b"x" * 100, server.getsockname())
        client.sendto(b"y" * 16, server.getsockname())
        batch = DatagramBatch(size=4, datagram_size=16)
        assert batch.receive(server.fileno()) == 2
        assert batch.datagram(0) == b"x" * 16 and batch.truncated(0)
        assert batch.datagram(1) == b"y" * 16 and not batch.truncated(1)
        known = {b"x" * 14: (b"", data_address(b""), 0), b"y" * 14: (b"", data_address(b""), 1)}
        assert batch.reply_known(2, known) == ([], [0, 1])  # a slot filled to the brim may be cut


def test_ipv6_senders_keep_port_flow_and_scope() -> None:
    try:
        server = bound(socket.AF_INET6, "::1")
    except OSError as err:
        pytest.skip(f"no IPv6 loopback here: {err}")
    with server, bound(socket.AF_INET6, "::1") as client:
        client.sendto(b"six", server.getsockname())
        batch = DatagramBatch(size=2, datagram_size=16)
        assert batch.receive(server.fileno()) == 1
        assert batch.sender(0) == client.getsockname()
        tail = b" back"
        assert batch.reply_known(1, {b"x": (tail, data_address(tail), None)}) == ([None], [])
        assert batch.send(server.fileno()) == 1
        assert client.recv(16) == b"si back"


def test_an_error_of_the_socket_is_raised_with_its_name() -> None:
    sock = bound(socket.AF_INET, "127.0.0.1")
    fd = sock.fileno()
    sock.close()
    batch = DatagramBatch(size=2, datagram_size=16)
    with pytest.raises(OSError, match="recvmmsg: EBADF") as raised:
        batch.receive(fd)
    assert raised.value.errno == errno.EBADF


def test_address_tuple_refuses_what_is_not_an_ip_address() -> None:
    with pytest.raises(ValueError, match="not an IP socket address"):
        address_tuple(socket.AF_UNIX.to_bytes(2, "little") + bytes(14))


def test_importing_the_module_loads_no_library_until_a_batch_is_made() -> None:
    """Issue 23: no module does work at import time; libc is loaded at the first use, once."""
    script = """
import ctypes
loaded = []
real = ctypes.PyDLL
ctypes.PyDLL = lambda *args, **kwargs: loaded.append(args) or real(*args, **kwargs)
import istio_agent.dns.mmsg as mmsg
import istio_agent.dns.server
assert loaded == [], loaded
assert mmsg.available()
mmsg.DatagramBatch(2, 512)
mmsg.available()
assert len(loaded) == 1, loaded
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
