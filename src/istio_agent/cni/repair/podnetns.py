"""Finding a running pod's network namespace from the host's /proc (Istio's ``netns_linux.go``).

Runtimes pin pod namespaces in places a pod cannot know in advance, so Istio looks at every process
of the host: the namespaces (``<proc>/<pid>/ns/net``) with an interface holding the pod's IP are the
pod's, and of their processes the oldest one (``starttime`` in ``<proc>/<pid>/stat``) is taken: the
pause container's, which outlives ``istio-validation``. Unlike Istio, each namespace is looked into
once however many processes share it (compared by device and inode), which turns a scan of a few
thousand processes into one of a few dozen namespaces.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Callable
from pathlib import Path

from istio_agent.cni.netns import CommandError, addresses

log = logging.getLogger("istio.cni-agent")

Addresses = Callable[[Path], list[str]]


class NetnsNotFound(Exception):
    """The pod's namespace could not be found (no process has it, or the pod IP is not usable)."""


def _start_time(proc: Path, pid: str) -> int | None:
    """The process's start time in clock ticks since boot (``stat`` field 22), or None."""
    try:
        stat = (proc / pid / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # the name, in parentheses, may hold anything
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _namespaces(proc: Path) -> dict[tuple[int, int], list[str]]:
    """The pids of ``proc`` grouped by network namespace (device, inode)."""
    groups: dict[tuple[int, int], list[str]] = {}
    try:
        entries = [entry.name for entry in os.scandir(proc) if entry.name.isdigit()]
    except OSError as err:
        raise NetnsNotFound(f"read procs in {proc}: {err.strerror or err}") from None
    for pid in entries:
        try:
            info = os.stat(proc / pid / "ns" / "net")
        except OSError:
            continue  # gone meanwhile, or a kernel thread's
        groups.setdefault((info.st_dev, info.st_ino), []).append(pid)
    return groups


def _holds(path: Path, target: ipaddress.IPv4Address | ipaddress.IPv6Address, read: Addresses) -> bool:
    try:
        found = read(path)
    except (CommandError, OSError):
        return False  # expected for most: exited, or not enterable
    for raw in found:
        try:
            if ipaddress.ip_address(raw.split("%")[0]) == target:
                return True
        except ValueError:
            continue
    return False


def find_pod_netns(pod_ip: str, proc: Path, *, read: Addresses = addresses) -> Path:
    """``<proc>/<pid>/ns/net`` of the oldest process whose namespace has ``pod_ip``; NetnsNotFound."""
    try:
        target = ipaddress.ip_address(pod_ip)
    except ValueError:
        raise NetnsNotFound(f"failed to parse addr: {pod_ip!r}") from None
    best: Path | None = None
    oldest: int | None = None
    for pids in _namespaces(proc).values():
        if not any(_holds(proc / pid / "ns" / "net", target, read) for pid in pids[:3]):
            continue
        for pid in pids:
            path = proc / pid / "ns" / "net"
            started = _start_time(proc, pid)
            if started is None:
                log.warning("failed to read proc %s stats", pid)
                best = best or path  # only if nothing better turns up
                continue
            if oldest is None or started < oldest:
                oldest, best = started, path
    if best is None:
        raise NetnsNotFound("failed to find network namespace")
    return best
