"""The policy routing TPROXY needs: marked packets are delivered locally (``run.go``, after the rules).

``fwmark <mark> lookup <table>`` and ``local default dev lo table <table>``, for IPv6 too when it is
on; with IPv6 the proxy's bind address ``::6/128`` goes on ``lo`` (the v6 counterpart of 127.0.0.6).
Each step checks first or replaces, so a re-run adds nothing (a rule, unlike a route, can be added
twice). Done over netlink inside the namespace (:mod:`istio_agent.cni.netlink`), as Istio's plugin
does, so the node needs no ``ip`` binary; errors name the step in ``ip``'s words.
"""

from __future__ import annotations

from pathlib import Path

from istio_agent.cni import netlink
from istio_agent.cni.capture_config import CaptureConfig
from istio_agent.cni.netns import NO_DEADLINE, CommandError, Deadline, netlink_in_namespace
from istio_agent.logline import Scope

BIND_V6 = "::6/128"
FAMILIES = ("v4", "v6")
log = Scope("cni")


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
    fwmark, number = int(mark, 0), int(table)

    def add() -> None:
        for family in families:
            if family == "v6":
                netlink.replace_address("::6", 128, "lo")
            if not tproxy:
                continue
            if not netlink.has_mark_rule(family, fwmark, number):
                netlink.add_mark_rule(family, fwmark, number)
            netlink.replace_local_default_route(family, number, "lo")

    what = ("ip", "rule", "add", "fwmark", mark, "lookup", table) if tproxy else ("ip", "address", "replace")
    netlink_in_namespace(what, netns, deadline, add)


def remove(
    families: tuple[str, ...],
    mark: str,
    table: str,
    *,
    netns: Path | None = None,
    deadline: Deadline = NO_DEADLINE,
) -> None:
    """Take the TPROXY rule and route table away."""
    fwmark, number = int(mark, 0), int(table)

    def take_away() -> None:
        for family in families:
            if netlink.delete_mark_rules(family, fwmark, number):
                netlink.flush_table(family, number)

    netlink_in_namespace(("ip", "rule", "del", "fwmark", mark, "lookup", table), netns, deadline, take_away)


def follow_rules(
    config: CaptureConfig,
    action: str,
    *,
    cleanup_only: bool,
    netns: Path | None,
    deadline: Deadline,
) -> None:
    """The routing step after a rules step whose outcome was ``action`` (``applied``, ``replaced``,
    ``unchanged``, ``cleaned``, ``clean``), for either backend. Raises CommandError when the step
    fails: the caller then puts its rules back (unless it wrote nothing).

    A replacement by a config without TPROXY removes the old routing last, once the new rules are
    in: a failure there leaves routing that nothing marks packets for, which is harmless, where
    removing it first and then failing would leave restored TPROXY rules without their routes.
    """
    mark, table = config.tproxy_mark, config.tproxy_route_table
    if cleanup_only:
        remove(FAMILIES, mark, table, netns=netns, deadline=deadline)
        return
    families = FAMILIES if config.enable_ipv6 else ("v4",)
    ensure(families, mark, table, tproxy=config.tproxy, netns=netns, deadline=deadline)
    if action == "replaced" and not config.tproxy:
        try:
            remove(FAMILIES, mark, table, netns=netns, deadline=deadline)
        except CommandError as err:
            log.warning(
                "the old TPROXY routing (fwmark %s, table %s) could not be removed: %s", mark, table, err
            )
