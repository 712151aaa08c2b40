"""One apply at a time per network namespace: a lock that lives in the namespace itself.

Applying the capture rules is check, write and (on failure) roll back; two runs interleaving on one
namespace can both see no rules, both write, and the one that fails restores its empty snapshot over
the rules the other installed. Runs therefore take turns on this lock.

The lock is an abstract Unix socket bound in the namespace: the name exists only in that namespace,
and the kernel frees it when the holder exits, however it exits. It is not a lock on the namespace
file, because legacy iptables already flocks that file for each of its own commands
(``XTABLES_LOCKFILE``, see ``cni/iptables.py``), so holding it across an apply would make our own
commands wait for us; and it is no file on disk, because a pod's init container may have nowhere to
write.
"""

from __future__ import annotations

import errno
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from istio_agent.cni.netns import Deadline, NamespaceError, in_namespace

LOCK_NAME = "istio-agent/capture-rules"
"""The abstract socket's name (``@istio-agent/capture-rules`` in ``ss -xl``)."""
WAIT_SECONDS = 30.0
"""The longest wait for the lock when the caller has no deadline of its own."""


class LockError(Exception):
    """The lock could not be taken; the message says why."""


@contextmanager
def namespace_lock(netns: Path | None, deadline: Deadline) -> Iterator[None]:
    """Hold the lock of ``netns`` (default: the current namespace) for the ``with`` block."""
    sock = _socket_in(netns)
    try:
        _bind_when_free(sock, netns, deadline)
        yield
    finally:
        sock.close()


def _bind_when_free(sock: socket.socket, netns: Path | None, deadline: Deadline) -> None:
    left = WAIT_SECONDS if deadline.at is None else deadline.at - time.monotonic()
    give_up = time.monotonic() + max(0.0, left)
    pause = 0.001
    while True:
        try:
            sock.bind("\0" + LOCK_NAME)
            return
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise LockError(f"cannot take the capture-rules lock of {_name(netns)}: {err}") from None
        if time.monotonic() + pause > give_up:
            raise LockError(
                f"another process held the capture-rules lock of {_name(netns)} (abstract socket"
                f" @{LOCK_NAME}) for the whole time budget"
            )
        time.sleep(pause)  # the holder's run takes milliseconds; there is nothing to await here
        pause = min(pause * 2, 0.05)


def _socket_in(netns: Path | None) -> socket.socket:
    """A Unix socket of ``netns``: a socket belongs to the namespace of the thread that made it."""
    try:
        return in_namespace(netns, lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    except NamespaceError as err:
        raise LockError(str(err)) from None


def _name(netns: Path | None) -> str:
    return f"network namespace {netns}" if netns is not None else "this network namespace"
