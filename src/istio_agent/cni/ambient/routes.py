"""The in-pod policy routing of ambient: replies to ztunnel's spoofed connections are delivered locally.

ztunnel connects to the app with the original client's address (``IP_TRANSPARENT``); the app's
replies carry connmark 0x111 (restored as the packet mark by the in-pod rules), and must come back to
ztunnel, not leave by the default route. Istio (``cni/pkg/iptables/iptables_linux.go``):
``ip rule add fwmark 0x111/0xfff pref 32764 lookup 100`` and ``ip route replace local 0.0.0.0/0 dev
lo table 100``, for IPv6 too when enabled (the v6 route only when ``lo`` has IPv6: a pod may turn it
off there). Over netlink in the pod's namespace, with the requests of
:mod:`istio_agent.cni.netlink`; adding is idempotent, and so is removing (what is gone is skipped).
"""

from __future__ import annotations

import contextlib
import errno
import functools
from pathlib import Path

from istio_agent.cni import netlink
from istio_agent.cni.ambient.settings import MARK_RULE_PRIORITY, ROUTE_TABLE, TPROXY_MARK, TPROXY_MASK
from istio_agent.cni.netns import NO_DEADLINE, Deadline, netlink_in_namespace
from istio_agent.logline import Scope

LO_IPV6_DISABLED = Path("/proc/sys/net/ipv6/conf/lo/disable_ipv6")
"""Read from a thread inside the namespace: ``/proc/sys/net`` shows the reader's namespace."""
log = Scope("cni")
_MARK_RULE = {"mask": TPROXY_MASK, "priority": MARK_RULE_PRIORITY}
"""``fwmark 0x111/0xfff pref 32764``, looking up ROUTE_TABLE."""


def _families(ipv6: bool) -> tuple[str, ...]:
    return ("v4", "v6") if ipv6 else ("v4",)


def _lo_has_ipv6() -> bool:
    try:
        return LO_IPV6_DISABLED.read_text().strip() != "1"
    except OSError as err:  # as Istio: carry on, it may work anyway
        log.warning("cannot read %s: %s; adding the IPv6 route anyway", LO_IPV6_DISABLED, err)
        return True


def ensure(ipv6: bool, *, netns: Path | None = None, deadline: Deadline = NO_DEADLINE) -> None:
    """The loopback route and the mark rule of each family, added where missing; raises CommandError."""

    def add() -> None:
        for family in _families(ipv6):
            if family == "v6" and not _lo_has_ipv6():
                log.debug("IPv6 is on, but lo has IPv6 disabled: no IPv6 loopback route")
            else:
                netlink.replace_local_default_route(family, ROUTE_TABLE, "lo")
            with contextlib.suppress(FileExistsError):  # already there: EEXIST, thanks to exclusive
                netlink.add_mark_rule(family, TPROXY_MARK, ROUTE_TABLE, exclusive=True, **_MARK_RULE)

    what = ("ip", "rule", "add", "fwmark", f"{TPROXY_MARK:#x}/{TPROXY_MASK:#x}", "lookup", str(ROUTE_TABLE))
    netlink_in_namespace(what, netns, deadline, add)


def remove(ipv6: bool, *, netns: Path | None = None, deadline: Deadline = NO_DEADLINE) -> None:
    """Take the mark rule and the loopback route away, where present; raises CommandError."""

    def take_away() -> None:
        for family in _families(ipv6):
            for delete in (
                functools.partial(netlink.delete_mark_rule, family, TPROXY_MARK, ROUTE_TABLE, **_MARK_RULE),
                functools.partial(netlink.delete_local_default_route, family, ROUTE_TABLE, "lo"),
            ):
                try:
                    delete()
                except OSError as err:
                    if err.errno not in (errno.ENOENT, errno.ESRCH):
                        raise

    what = ("ip", "rule", "del", "fwmark", f"{TPROXY_MARK:#x}/{TPROXY_MASK:#x}", "lookup", str(ROUTE_TABLE))
    netlink_in_namespace(what, netns, deadline, take_away)
