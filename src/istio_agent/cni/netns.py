"""Working inside a pod's network namespace: commands, its addresses, and any other step.

A node offers the plugin nothing but its iptables binaries (no ``nsenter``, ``ip`` or ``sh``), so
the namespace is entered in-process, as Istio's plugin does: :func:`in_namespace` runs a step on a
short-lived thread that has called ``setns(2)`` on the namespace (which moves only that thread), and
whatever the step starts there (a command, a netlink socket) lives in the pod's namespace.
Commands started from that thread still use ``vfork`` (no ``preexec_fn``), so entering costs a
thread (~0.1 ms), not a process. :func:`in_new_namespace` does the same in a fresh, empty namespace
(``unshare(2)``), for trying rules out.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from istio_agent.cni import netlink

T = TypeVar("T")
CLONE_NEWNET = 0x40000000


class CommandError(Exception):
    """A command failed, timed out or could not start; the message names it and carries its stderr."""

    def __init__(self, argv: Sequence[str], problem: str, stderr: str = "") -> None:
        self.argv = tuple(argv)
        self.problem = problem
        self.stderr = stderr.strip()
        detail = f": {self.stderr}" if self.stderr else ""
        super().__init__(f"{' '.join(self.argv)} {problem}{detail}")


@dataclass(frozen=True)
class Deadline:
    """One time budget for a sequence of commands (the plugin's ADD deadline), on the monotonic clock."""

    at: float | None = None

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        return cls(None if seconds is None else time.monotonic() + seconds)

    def remaining(self, what: Sequence[str]) -> float | None:
        """Seconds left, or an error naming the command that no longer fits in the budget."""
        if self.at is None:
            return None
        left = self.at - time.monotonic()
        if left <= 0:
            raise CommandError(what, "not started: the time budget is spent")
        return left


NO_DEADLINE = Deadline()


class NamespaceError(OSError):
    """The namespace cannot be entered (it is gone, or this process may not enter it)."""


def in_namespace(netns: Path | None, step: Callable[[], T]) -> T:
    """``step()`` run inside ``netns`` (None: here, on the calling thread); its result or its exception.

    Raises NamespaceError when the namespace cannot be entered.
    """
    if netns is None:
        return step()
    return _on_thread(lambda: _setns(netns), step)


def netlink_in_namespace(
    what: tuple[str, ...], netns: Path | None, deadline: Deadline, step: Callable[[], object]
) -> None:
    """Netlink requests (``step``) inside ``netns``, failing as a command would: CommandError naming
    ``what`` (the ``ip`` command it stands for) when the deadline passed, the namespace cannot be
    entered, or the kernel refused."""
    deadline.remaining(what)
    try:
        in_namespace(netns, step)
    except NamespaceError as err:
        raise CommandError(what, f"not run: {err}") from None
    except OSError as err:
        raise CommandError(what, f"failed (netlink): {err.strerror or err}") from None


def in_new_namespace(step: Callable[[], T]) -> T:
    """``step()`` run inside a new, empty network namespace, gone once the step ends."""
    return _on_thread(_unshare, step)


def _on_thread(enter: Callable[[], None], step: Callable[[], T]) -> T:
    outcome: list[T] = []
    failure: list[BaseException] = []

    def body() -> None:
        try:
            enter()
            outcome.append(step())
        except BaseException as err:  # handed to the caller, whatever it is
            failure.append(err)

    thread = threading.Thread(target=body, name="netns")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]


def _setns(netns: Path) -> None:
    try:
        fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NamespaceError(f"network namespace {netns} does not exist") from None
    except OSError as err:
        raise NamespaceError(f"cannot open network namespace {netns}: {err.strerror}") from None
    try:
        if _libc().setns(fd, CLONE_NEWNET) != 0:
            code = ctypes.get_errno()
            raise NamespaceError(f"cannot enter network namespace {netns}: {os.strerror(code)}")
    finally:
        os.close(fd)


def _unshare() -> None:
    if _libc().unshare(CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        raise NamespaceError(f"cannot make a network namespace: {os.strerror(code)}")


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def run(
    argv: Sequence[str],
    *,
    netns: Path | None = None,
    stdin: str | None = None,
    env: Mapping[str, str] | None = None,
    deadline: Deadline = NO_DEADLINE,
) -> str:
    """Run ``argv`` (inside ``netns`` when given) and return its stdout; any failure is a CommandError."""
    timeout = deadline.remaining(argv)

    def start() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            input=stdin,
            capture_output=True,
            text=True,
            env=dict(env) if env is not None else None,
            timeout=timeout,
            check=False,
        )

    try:
        done = in_namespace(netns, start)
    except NamespaceError as err:
        raise CommandError(argv, f"not run: {err}") from None
    except subprocess.TimeoutExpired:
        raise CommandError(argv, "timed out: the time budget is spent") from None
    except OSError as err:
        raise CommandError(argv, f"could not start: {err.strerror}") from None
    if done.returncode != 0:
        raise CommandError(argv, f"failed (exit status {done.returncode})", done.stderr)
    return done.stdout


def addresses(netns: Path | None = None, *, deadline: Deadline = NO_DEADLINE) -> list[str]:
    """The namespace's interface addresses in the kernel's order (as Go's ``net.InterfaceAddrs``
    reads them: one netlink dump); raises CommandError."""
    what = ("ip", "address", "show")
    deadline.remaining(what)
    try:
        return in_namespace(netns, netlink.addresses)
    except NamespaceError as err:
        raise CommandError(what, f"not run: {err}") from None
    except OSError as err:
        raise CommandError(what, f"failed (netlink): {err.strerror or err}") from None


def pod_ipv6(netns: Path | None, *, dual_stack: bool, deadline: Deadline = NO_DEADLINE) -> bool:
    """Whether the namespace's (default: the current one's) rules include IPv6: :func:`ipv6_enabled`
    on its addresses. Raises CommandError."""
    return ipv6_enabled(addresses(netns, deadline=deadline), dual_stack=dual_stack)


def ipv6_enabled(addrs: Iterable[str], *, dual_stack: bool) -> bool:
    """Whether the pod is IPv6, as istio-iptables decides it (``getLocalIP``).

    The first address that is neither loopback nor link-local decides; in dual-stack any IPv6
    address turns IPv6 on. A namespace with no such address stays IPv4.
    """
    for raw in addrs:
        address = ipaddress.ip_address(raw.split("%")[0])
        if address.is_loopback or address.is_link_local:
            continue
        if address.version == 6:
            return True
        if not dual_stack:
            return False
    return False
