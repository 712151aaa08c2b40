"""The policy routing TPROXY needs: marked packets are delivered locally (``run.go``, after the rules).

``fwmark <mark> lookup <table>`` and ``local default dev lo table <table>``, for IPv6 too when it is
on; with IPv6 the proxy's bind address ``::6/128`` goes on ``lo`` (the v6 counterpart of 127.0.0.6).
Each step checks first or replaces, so a re-run adds nothing (a rule, unlike a route, can be added
twice). Done over netlink inside the namespace (:mod:`istio_agent.cni.netlink`), as Istio's plugin
does, so the node needs no ``ip`` binary; errors name the step in ``ip``'s words.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from istio_agent.cni import netlink
from istio_agent.cni.netns import NO_DEADLINE, CommandError, Deadline, NamespaceError, in_namespace

BIND_V6 = "::6/128"


def _step(
    what: tuple[str, ...], netns: Path | None, deadline: Deadline, action: Callable[[], object]
) -> None:
    deadline.remaining(what)
    try:
        in_namespace(netns, action)
    except NamespaceError as err:
        raise CommandError(what, f"not run: {err}") from None
    except OSError as err:
        raise CommandError(what, f"failed (netlink): {err.strerror or err}") from None


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
    _step(what, netns, deadline, add)


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

    _step(("ip", "rule", "del", "fwmark", mark, "lookup", table), netns, deadline, take_away)
