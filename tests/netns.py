"""Network namespaces a test creates: named ones (``ip netns add``), and sockets made inside any namespace.

Root only. A named namespace lives under ``/run/netns/<name>`` until :meth:`NetNamespace.delete`;
the names carry the test process's pid so concurrent runs never meet.
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")

_libc = ctypes.CDLL(None, use_errno=True)


def socket_in(
    netns: Path, family: socket.AddressFamily = socket.AF_INET, kind: socket.SocketKind = socket.SOCK_STREAM
) -> socket.socket:
    """A socket made in the network namespace ``netns`` (it stays there whatever thread uses it)."""
    made: list[socket.socket | OSError] = []

    def make() -> None:  # setns() moves only this short-lived thread into the namespace
        fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if _libc.setns(fd, CLONE_NEWNET) != 0:
                errno = ctypes.get_errno()
                made.append(OSError(errno, f"setns({netns}): {os.strerror(errno)}"))
                return
        finally:
            os.close(fd)
        made.append(socket.socket(family, kind))

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    if isinstance(made[0], OSError):
        raise made[0]
    return made[0]


def in_netns(netns: Path, args: Sequence[str]) -> list[str]:
    """``args`` as a command that runs inside ``netns``."""
    return ["nsenter", f"--net={netns}", "--", *args]


class NetNamespace:
    """A named network namespace with loopback up; :meth:`delete` removes it and everything in it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.path = NETNS_DIR / name

    def create(self) -> NetNamespace:
        subprocess.run(["ip", "netns", "add", self.name], check=True, env={"PATH": HOST_PATH})
        self.run(["ip", "link", "set", "lo", "up"])
        return self

    def delete(self) -> None:
        """Remove the namespace (its interfaces, addresses and rules go with it); no error if it is gone."""
        if self.path.exists():
            subprocess.run(["ip", "netns", "delete", self.name], check=True, env={"PATH": HOST_PATH})

    def run(self, args: Sequence[str], stdin: str | None = None) -> str:
        """Run a command inside the namespace as root; its stdout; CalledProcessError (with stderr) on failure."""
        done = subprocess.run(
            in_netns(self.path, args),
            input=stdin,
            capture_output=True,
            text=True,
            env={"PATH": HOST_PATH},
            timeout=30,
            check=False,
        )
        if done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, list(args), done.stdout, done.stderr)
        return done.stdout

    def socket(
        self, family: socket.AddressFamily = socket.AF_INET, kind: socket.SocketKind = socket.SOCK_STREAM
    ) -> socket.socket:
        return socket_in(self.path, family, kind)
