"""Applying ambient's in-pod redirection in a pod's network namespace (Istio's ``CreateInpodRules``
and ``DeleteInpodRules``, ``cni/pkg/iptables/iptables.go`` and ``cni/pkg/nftables/nftables.go``).

The rules (:mod:`istio_agent.cni.ambient.inpod_rules`) go in with the sidecar's appliers, so they
inherit their guarantees: the namespace is entered in-process, an identical set is left alone (no
command writes), a different Istio set is replaced in one transaction per table (with
``reconcile`` off it is an error instead), a failure puts back what was there, and concurrent
applies on one namespace take turns. Then the policy routing (:mod:`istio_agent.cni.ambient.routes`).
Istio adds the routes first and the rules after; here a failing route rolls the rules back.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from istio_agent.cni.ambient import routes
from istio_agent.cni.ambient.inpod_rules import TABLES, iptables_rules, nft_rules, render_nft
from istio_agent.cni.ambient.settings import InpodSettings, PodRedirect, dns_capture
from istio_agent.cni.apply import ApplyError, apply_rule_set
from istio_agent.cni.iptables import detect
from istio_agent.cni.netns import CommandError, Deadline
from istio_agent.cni.nftables.apply import apply_nft_tables
from istio_agent.config.env import ConfigError
from istio_agent.logline import Scope

__all__ = [
    "ApplyError",
    "InpodSettings",
    "PodRedirect",
    "apply_inpod",
    "dns_capture",
    "iptables_rules",
    "nft_rules",
    "remove_inpod",
    "render_nft",
]
log = Scope("cni")
DEFAULT_SECONDS = 30.0
"""The budget of one apply or removal when the caller gives none."""


def with_backend(settings: InpodSettings) -> InpodSettings:
    """``settings`` with the iptables flavour detected here, for every pod from now on (Istio detects
    the node's binaries once, when its node agent starts, not at each pod: that is one or two
    ``iptables-*-save`` runs less per pod). Unchanged with native nftables or a flavour already set;
    ApplyError when no iptables binary is usable (detected again next time)."""
    if settings.native_nftables or settings.iptables_backend is not None:
        return settings
    try:
        backend = detect(os.environ, deadline=Deadline(time.monotonic() + DEFAULT_SECONDS))
    except (CommandError, ConfigError) as err:
        raise ApplyError(str(err)) from None
    return dataclasses.replace(settings, iptables_backend=backend)


def apply_inpod(
    netns: Path, settings: InpodSettings, pod: PodRedirect, *, deadline: float | None = None
) -> str:
    """Make the pod's namespace redirect to ztunnel: the rules, then the routes. Idempotent.

    Returns the action (``applied``, ``unchanged``, ``replaced``); raises ApplyError naming the
    failing command, with the namespace left as it was. ``deadline``: a ``time.monotonic()`` instant.
    """
    budget = deadline if deadline is not None else time.monotonic() + DEFAULT_SECONDS
    if settings.force_apply:
        remove_inpod(netns, settings, deadline=budget)

    def with_routes(action: str, left: Deadline) -> None:
        routes.ensure(settings.ipv6, netns=netns, deadline=left)

    try:
        if settings.native_nftables:
            wanted = render_nft(nft_rules(settings, pod))
            outcome = apply_nft_tables(
                wanted, tables=TABLES, netns=netns, deadline=budget, read_back=False, after=with_routes
            )
            action = outcome.action
        else:
            result = apply_rule_set(
                iptables_rules(settings, pod),
                ipv6=settings.ipv6,
                netns=netns,
                deadline=budget,
                backend=settings.iptables_backend,
                read_back=False,
                replace=settings.reconcile,
                after=with_routes,
            )
            action = result.action
    except ConfigError as err:
        raise ApplyError(str(err)) from None
    log.info("in-pod redirection in %s: %s", netns, action)
    return action


def remove_inpod(netns: Path, settings: InpodSettings, *, deadline: float | None = None) -> str:
    """Take the pod's redirection away: Istio's rules of the configured backend, the mark rule and
    the loopback route. Idempotent; returns ``cleaned`` or ``clean``; raises ApplyError."""
    budget = deadline if deadline is not None else time.monotonic() + DEFAULT_SECONDS

    def without_routes(action: str, left: Deadline) -> None:
        routes.remove(settings.ipv6, netns=netns, deadline=left)

    if settings.native_nftables:
        outcome = apply_nft_tables(
            "",
            tables=TABLES,
            netns=netns,
            cleanup_only=True,
            deadline=budget,
            read_back=False,
            after=without_routes,
        )
        return outcome.action
    result = apply_rule_set(
        iptables_rules(settings, PodRedirect()),
        ipv6=settings.ipv6,
        netns=netns,
        cleanup_only=True,
        deadline=budget,
        backend=settings.iptables_backend,
        read_back=False,
        after=without_routes,
    )
    return result.action
