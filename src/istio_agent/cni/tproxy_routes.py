"""The policy routing TPROXY needs: marked packets are delivered locally (``run.go``, after the rules).

``ip rule add fwmark <mark> lookup <table>`` and ``ip route add local default dev lo table <table>``,
for IPv6 too when it is on; with IPv6 the proxy's bind address ``::6/128`` goes on ``lo`` (the v6
counterpart of 127.0.0.6). Each step checks first or uses ``replace``, so a re-run adds nothing:
``ip rule add`` would happily add the same rule twice.
"""

from __future__ import annotations

import json
from pathlib import Path

from istio_agent.cni.netns import NO_DEADLINE, CommandError, Deadline, run

BIND_V6 = "::6/128"


def _family_flag(family: str) -> list[str]:
    return ["-6"] if family == "v6" else []


def _rule_present(family: str, mark: str, table: str, netns: Path | None, deadline: Deadline) -> bool:
    argv = ["ip", *_family_flag(family), "-j", "rule", "show", "fwmark", mark, "lookup", table]
    try:
        return bool(json.loads(run(argv, netns=netns, deadline=deadline) or "[]"))
    except json.JSONDecodeError as err:
        raise CommandError(argv, f"printed output that is not JSON ({err})") from None


def ensure(
    families: tuple[str, ...],
    mark: str,
    table: str,
    *,
    tproxy: bool,
    netns: Path | None = None,
    deadline: Deadline = NO_DEADLINE,
) -> None:
    """The routes of the families given, added where missing; ``::6`` on lo whenever v6 is among them."""
    for family in families:
        flag = _family_flag(family)
        if family == "v6":
            run(["ip", "-6", "address", "replace", BIND_V6, "dev", "lo"], netns=netns, deadline=deadline)
        if not tproxy:
            continue
        if not _rule_present(family, mark, table, netns, deadline):
            run(["ip", *flag, "rule", "add", "fwmark", mark, "lookup", table], netns=netns, deadline=deadline)
        route = ["ip", *flag, "route", "replace", "local", "default", "dev", "lo", "table", table]
        run(route, netns=netns, deadline=deadline)


def remove(
    families: tuple[str, ...],
    mark: str,
    table: str,
    *,
    netns: Path | None = None,
    deadline: Deadline = NO_DEADLINE,
) -> None:
    """Take the TPROXY rule and route table away."""
    for family in families:
        flag = _family_flag(family)
        present = False
        while _rule_present(family, mark, table, netns, deadline):
            run(["ip", *flag, "rule", "del", "fwmark", mark, "lookup", table], netns=netns, deadline=deadline)
            present = True
        if present:
            run(["ip", *flag, "route", "flush", "table", table], netns=netns, deadline=deadline)
