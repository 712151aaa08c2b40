"""Applying ambient's host-probe rules and keeping their set of pod IPs (the node's namespace).

Istio's ``CreateHostRulesForHealthChecks``/``DeleteHostRules`` and its probe set
(``cni/pkg/ipset``, ``cni/pkg/nftables/host_sets.go``). With iptables the set is an ipset
(``istio-inpod-probes-v4``/``-v6``, ``hash:ip`` with comments, via Debian's ``ipset``, where Istio
speaks netlink), the rules go in with the shared applier (idempotent, rolled back on failure); with
native nftables the sets live in the table ``inet istio-ambient-nat`` next to its postrouting chain,
and the rules are Istio's transaction (add, flush, fill: the sets keep their elements). Each
element's comment is the pod's UID, so a pod that goes away only removes its own entry, not that of
a new pod that got the same IP (Istio's ``ClearEntriesWithIPAndComment``). Never the in-pod side:
see :mod:`istio_agent.cni.ambient.inpod`.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from istio_agent.cni.ambient.hostprobe_rules import (
    SET_V4,
    SET_V6,
    iptables_rules,
    nft_rules,
    nft_sets,
    render_nft,
)
from istio_agent.cni.ambient.inpod_rules import NAT
from istio_agent.cni.ambient.settings import InpodSettings
from istio_agent.cni.apply import ApplyError, apply_rule_set
from istio_agent.cni.netns import CommandError, Deadline, run
from istio_agent.logline import Scope

__all__ = ["HostProbeRules", "iptables_rules", "kubelet_uid", "nft_rules", "nft_sets", "render_nft"]
log = Scope("cni")
COMMAND_SECONDS = 10.0
"""The budget of one operation (a few ``ipset``/``nft``/iptables commands)."""


def kubelet_uid(proc: Path = Path("/proc")) -> str:
    """The real uid of the kubelet process (``kubeletuid_linux.go``): comm ``kubelet`` and a command
    line that says kubelet. Native nftables matches kubelet's sockets by it. Raises LookupError."""
    for entry in sorted(proc.iterdir(), key=lambda p: p.name):
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "kubelet":
                continue
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            if not any(b"kubelet" in arg.lower() for arg in cmdline):
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("Uid:"):
                    return line.split()[1]
        except OSError:  # the process went away meanwhile
            continue
    raise LookupError(f"kubelet process not found in {proc}")


class HostProbeRules:
    """The node's probe SNAT: ``install()`` once at start, pod IPs in and out as pods are enrolled,
    ``uninstall()`` when the node agent goes away for good (not for an upgrade).

    ``netns``: the node's namespace (None: the current one; tests pass a namespace standing for the
    host). ``kubelet_uid``: for native nftables, else found in ``proc`` at install. Every method
    raises ApplyError naming the failing command.
    """

    def __init__(
        self,
        settings: InpodSettings,
        *,
        netns: Path | None = None,
        kubelet_uid: str | None = None,
        proc: Path = Path("/proc"),
    ) -> None:
        self.settings = settings
        self.netns = netns
        self._kubelet_uid = kubelet_uid
        self._proc = proc

    # -- rules -------------------------------------------------------------------------------------

    def install(self) -> None:
        """The probe sets (kept if present, with their entries) and the SNAT rules; idempotent."""
        if self.settings.native_nftables:
            uid = self._kubelet_uid
            if uid is None:
                try:
                    uid = kubelet_uid(self._proc)
                except LookupError as err:
                    raise ApplyError(f"failed to get the kubelet uid: {err}") from None
            self._nft(nft_sets(self.settings) + render_nft(nft_rules(self.settings, uid)))
            return
        self._ipset(
            "".join(
                f"create {name} hash:ip family {family} comment -exist\n" for name, family in self._ipsets()
            )
        )
        self._apply(cleanup_only=False)

    def uninstall(self) -> None:
        """The rules, then the sets and their entries; idempotent."""
        if self.settings.native_nftables:
            self._nft(f"add table inet {NAT}\ndelete table inet {NAT}\n")
            return
        self._apply(cleanup_only=True)
        present = set(self._run(["ipset", "list", "-n"]).split())
        for name in (SET_V4, SET_V6):
            if name in present:
                self._run(["ipset", "destroy", name])

    # -- the set of enrolled pod IPs ---------------------------------------------------------------

    def add_pod_ips(self, ips: Iterable[str], *, uid: str = "") -> None:
        """Put the pod's IPs in the set (an entry already there takes ``uid`` as its comment); v6 IPs
        only with IPv6 on (else skipped, as Istio skips them)."""
        entries = self._by_set(ips)
        if not entries:
            return
        comment = _quoted(uid)
        if self.settings.native_nftables:
            self._nft(
                "".join(
                    f"add element inet {NAT} {name} {{ {ip} comment {comment} }}\n" for name, ip in entries
                )
            )
        else:
            self._ipset("".join(f"add {name} {ip} comment {comment} -exist\n" for name, ip in entries))

    def remove_pod_ips(self, ips: Iterable[str], *, uid: str | None = None) -> None:
        """Take the IPs out of the set; with ``uid``, only entries of that pod (comment). Missing ones
        are skipped."""
        present = self.pod_ips()
        gone = [(name, ip) for name, ip in self._by_set(ips) if ip in present and uid in (None, present[ip])]
        if not gone:
            return
        if self.settings.native_nftables:
            self._nft("".join(f"delete element inet {NAT} {name} {{ {ip} }}\n" for name, ip in gone))
        else:
            self._ipset("".join(f"del {name} {ip} -exist\n" for name, ip in gone))

    def pod_ips(self) -> dict[str, str]:
        """The IPs in the sets, with their comments (the pod UIDs): what a restarted agent finds."""
        found: dict[str, str] = {}
        for name in (SET_V4, SET_V6) if self.settings.ipv6 else (SET_V4,):
            if self.settings.native_nftables:
                found.update(self._nft_elements(name))
            else:
                found.update(self._ipset_elements(name))
        return found

    # -- helpers -----------------------------------------------------------------------------------

    def _ipsets(self) -> list[tuple[str, str]]:
        return [(SET_V4, "inet"), *([(SET_V6, "inet6")] if self.settings.ipv6 else [])]

    def _by_set(self, ips: Iterable[str]) -> list[tuple[str, str]]:
        entries = []
        for raw in ips:
            ip = ipaddress.ip_address(raw)
            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                ip = ip.ipv4_mapped  # Istio unmaps ::ffff:a.b.c.d
            if ip.version == 6 and not self.settings.ipv6:
                log.debug("IPv6 is off: not adding or removing %s", ip)
                continue
            entries.append((SET_V4 if ip.version == 4 else SET_V6, str(ip)))
        return entries

    def _ipset_elements(self, name: str) -> dict[str, str]:
        try:
            saved = self._run(["ipset", "save", name])
        except ApplyError:
            return {}  # no such set (not installed): no entries
        found = {}
        for line in saved.splitlines():
            words = line.split(" ", 3)
            if len(words) >= 3 and words[0] == "add" and words[1] == name:
                comment = words[3] if len(words) == 4 else ""
                found[words[2]] = _unquoted(comment.removeprefix("comment "))
        return found

    def _nft_elements(self, name: str) -> dict[str, str]:
        try:
            listed = json.loads(self._run([self._nft_binary(), "-j", "list", "set", "inet", NAT, name]))
        except ApplyError:
            return {}
        found = {}
        for item in listed.get("nftables", []):
            for element in item.get("set", {}).get("elem", []):
                if isinstance(element, dict):
                    found[str(element["elem"]["val"])] = str(element["elem"].get("comment", ""))
                else:
                    found[str(element)] = ""
        return found

    def _apply(self, *, cleanup_only: bool) -> None:
        budget = Deadline.after(COMMAND_SECONDS)

        def sets_here() -> None:  # the rules name the sets: where they are tried out, the sets must be
            script = "".join(
                f"create {name} hash:ip family {family} comment -exist\n" for name, family in self._ipsets()
            )
            run(["ipset", "restore"], stdin=script, deadline=budget)

        apply_rule_set(
            iptables_rules(self.settings),
            ipv6=self.settings.ipv6,
            netns=self.netns,
            cleanup_only=cleanup_only,
            deadline=budget.at,
            backend=self.settings.iptables_backend,
            read_back=False,
            prepare=sets_here,
        )

    def _ipset(self, script: str) -> None:
        self._run(["ipset", "restore"], stdin=script)

    def _nft(self, transaction: str) -> None:
        self._run([self._nft_binary(), "-f", "-"], stdin=transaction)

    def _nft_binary(self) -> str:
        found = shutil.which("nft", path=os.environ.get("PATH", os.defpath))
        if found is None:
            raise ApplyError("nativeNftables is enabled, but the nft binary is missing")
        return found

    def _run(self, argv: list[str], *, stdin: str | None = None) -> str:
        try:
            return run(argv, netns=self.netns, stdin=stdin, deadline=Deadline.after(COMMAND_SECONDS))
        except CommandError as err:
            raise ApplyError(str(err)) from None


def _quoted(text: str) -> str:
    """A comment as ipset and nft read it: in double quotes, which it may not contain itself."""
    if '"' in text or "\n" in text or "\\" in text:
        raise ApplyError(f"invalid set comment {text!r}")
    return f'"{text}"'


def _unquoted(text: str) -> str:
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text
