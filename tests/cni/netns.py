"""Network namespaces for the CNI tests: a "pod" with lo up, optionally wired to a "peer" by a veth.

Names are unique per process and call (``ia-<pid>-<n>-<role>``) and every namespace is deleted on
exit, even when the test fails. Root only: ``needs_root`` skips with the reason otherwise. Sockets
are made inside any namespace (a named one, or a process's ``/proc/<pid>/ns/net``) by a thread that
entered it (:func:`socket_in`), so the test process itself never changes namespace.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cni.as_user import as_user

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root and iproute2 to create network namespaces (CI runs as root)",
)
POD_IP, PEER_IP = "10.77.0.2", "10.77.0.1"
CLONE_NEWNET = 0x40000000
_counter = itertools.count()
_libc = ctypes.CDLL(None, use_errno=True)


def enter(path: Path) -> None:
    """Move the calling thread (only it) into the network namespace at ``path``: the sockets it makes
    from now on are there. For a thread started for that purpose, never the test's own."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns({path}): {os.strerror(errno)}")
    finally:
        os.close(fd)


def socket_in(
    path: Path, family: socket.AddressFamily = socket.AF_INET, kind: socket.SocketKind = socket.SOCK_STREAM
) -> socket.socket:
    """A socket made in the network namespace at ``path`` (it stays there whatever thread uses it)."""
    made: list[socket.socket | OSError] = []

    def make() -> None:  # a short-lived thread enters the namespace
        try:
            enter(path)
        except OSError as err:
            made.append(err)
            return
        made.append(socket.socket(family, kind))

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    if isinstance(made[0], OSError):
        raise made[0]
    return made[0]


def in_netns(path: Path, argv: Sequence[str]) -> list[str]:
    """``argv`` as a command that runs inside the network namespace at ``path``."""
    return ["nsenter", f"--net={path}", "--", *argv]


def sh(*argv: str, input: str | None = None) -> str:
    """Run a command, failing the test with its stderr if it fails."""
    done = subprocess.run(argv, input=input, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


@dataclass(frozen=True)
class Netns:
    name: str

    @property
    def path(self) -> Path:
        return Path("/run/netns") / self.name

    def exec(self, *argv: str, input: str | None = None) -> str:
        return sh("ip", "netns", "exec", self.name, *argv, input=input)

    def ip(self, *args: str) -> str:
        return sh("ip", "-n", self.name, *args)

    def socket(
        self, family: socket.AddressFamily = socket.AF_INET, kind: socket.SocketKind = socket.SOCK_STREAM
    ) -> socket.socket:
        return socket_in(self.path, family, kind)


@contextmanager
def netns(role: str = "pod") -> Iterator[Netns]:
    """A fresh namespace with lo up, deleted afterwards whatever happens."""
    name = f"ia-{os.getpid()}-{next(_counter)}-{role}"
    sh("ip", "netns", "add", name)
    try:
        space = Netns(name)
        space.ip("link", "set", "lo", "up")
        yield space
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)


@contextmanager
def pod_and_peer(*, ipv6: bool = False) -> Iterator[tuple[Netns, Netns]]:
    """A pod (10.77.0.2/24, default route via the peer) and a peer (10.77.0.1/24) joined by a veth.

    With ``ipv6`` both ends also get fd77::2/64 and fd77::1/64 (nodad: usable at once).
    """
    with ExitStack() as stack:
        pod = stack.enter_context(netns("pod"))
        peer = stack.enter_context(netns("peer"))
        sh("ip", "link", "add", "eth0", "netns", pod.name, "type", "veth", "peer", "eth0", "netns", peer.name)
        for space, address in ((pod, POD_IP), (peer, PEER_IP)):
            space.ip("address", "add", f"{address}/24", "dev", "eth0")
            if ipv6:
                suffix = "2" if space is pod else "1"
                space.ip("address", "add", f"fd77::{suffix}/64", "dev", "eth0", "nodad")
            space.ip("link", "set", "eth0", "up")
        pod.ip("route", "add", "default", "via", PEER_IP)
        yield pod, peer


PEER_SCRIPT = Path(__file__).with_name("traffic_peer.py")
SYSTEM_PYTHON = "/usr/bin/python3"


@dataclass
class Peer:
    """A running traffic_peer.py; ``line()`` is its next line of output (it times out by itself)."""

    process: subprocess.Popen[str]

    def line(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()


@contextmanager
def peer(space: Netns, uid: int, *args: str) -> Iterator[Peer]:
    """traffic_peer.py inside ``space`` as ``uid``; a listener has printed "ready" when this yields."""
    argv = ["ip", "netns", "exec", space.name, *as_user(uid, (Path(SYSTEM_PYTHON), PEER_SCRIPT))]
    argv += [SYSTEM_PYTHON, "-I", "-S", str(PEER_SCRIPT), *args]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    running = Peer(process)
    try:
        if args[0] == "listen":
            ready = running.line()
            assert ready == "ready", (
                f"{args} did not start: {ready!r} {process.stderr.read() if process.stderr else ''}"
            )
        yield running
    finally:
        process.kill()
        process.wait()


def run_peer(space: Netns, uid: int, *args: str) -> str:
    """Run a one-shot traffic_peer.py command (connect, send) and return what it printed."""
    with peer(space, uid, *args) as client:
        return client.line()
