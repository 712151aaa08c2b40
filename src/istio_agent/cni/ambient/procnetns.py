"""A running pod's network namespace, found from its UID by scanning ``/proc`` (the host's).

Istio's ``cni/pkg/nodeagent/podcgroupns_linux.go``: for a pod already running when it is enrolled
(its namespace relabelled) or after the node agent's restart, no plugin event names its namespace.
Every process's ``cgroup`` file names the pod it belongs to (kubelet puts a pod's containers under a
cgroup ``.../pod<UID>/<container>`` or, with the systemd driver, ``...-pod<UID with _>.slice/...``), so
the namespace of the oldest process of that pod (the sandbox's pause) is the pod's. The host's own
namespace is never a pod's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from pathlib import Path

from istio_agent.log import scope

log = scope("cni-agent")

HOST_PROC = Path("/host/proc")
"""Where Istio's DaemonSet mounts the host's ``/proc``."""
_PUNCT = r"[!-/:-@\[-`{-~]"
_WORD = r"[^!-/:-@\[-`{-~]"
_HEX = "[0-9a-fA-F]"
_UID = f"{_HEX}{{8}}{_PUNCT}?{_HEX}{{4}}{_PUNCT}?{_HEX}{{4}}{_PUNCT}?{_HEX}{{4}}{_PUNCT}?{_HEX}{{12}}"
_POD_CGROUP = re.compile(f"{_PUNCT}pod(?P<uid>{_UID}){_PUNCT}(?:{_WORD}+{_PUNCT})*(?P<container>{_WORD}+)$")
_PUNCTUATION = re.compile(_PUNCT)


def pod_uid_of_cgroup(path: str) -> str | None:
    """The pod UID a cgroup path names (canonical: punctuation as ``-``), None when it names none."""
    if path.endswith(".scope"):
        path = path[: -len(".scope")]
    match = _POD_CGROUP.search(path)
    return None if match is None else _PUNCTUATION.sub("-", match["uid"])


def pod_uid_of_process(cgroup_text: str) -> str | None:
    """The one pod UID a process's ``/proc/<pid>/cgroup`` names; None when none, or more than one."""
    found = set()
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and (uid := pod_uid_of_cgroup(parts[2])) is not None:
            found.add(uid)
    return found.pop() if len(found) == 1 else None


def _start_time(proc: Path, pid: str) -> int | None:
    try:
        stat = (proc / pid / "stat").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 1 :].split()
    return int(fields[19]) if len(fields) > 19 else None


def find_pod_netns(uids: Collection[str], proc: Path = HOST_PROC) -> dict[str, Path]:
    """``uid -> /proc/<pid>/ns/net`` for each of ``uids`` with a process on this host (its oldest)."""
    wanted = set(uids)
    if not wanted:
        return {}
    host = os.stat("/proc/self/ns/net")
    best: dict[str, tuple[int, Path]] = {}
    try:
        entries = os.listdir(proc)
    except OSError as err:
        log.error("cannot scan %s for pod network namespaces: %s", proc, err)
        return {}
    for pid in entries:
        if not pid.isdigit():
            continue
        netns = proc / pid / "ns" / "net"
        try:
            ns = os.stat(netns)
            cgroup = (proc / pid / "cgroup").read_text(errors="replace")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if (ns.st_ino, ns.st_dev) == (host.st_ino, host.st_dev):
            continue
        uid = pod_uid_of_process(cgroup)
        if uid is None or uid not in wanted:
            continue
        started = _start_time(proc, pid)
        if started is None:
            continue
        if uid not in best or started < best[uid][0]:
            best[uid] = (started, netns)
    return {uid: path for uid, (_, path) in best.items()}
