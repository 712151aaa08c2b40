"""Comparing the capture rules installed in a pod's network namespace with the ones its config expects.

Leftover or missing rules are the usual reason a pod's traffic bypasses its sidecar, or fails (a
rule from an old config that nobody removed, a chain a node agent never finished; istio#49067).
This reads the namespace only: the expected rules are put in iptables-save form in a throwaway
namespace (as ``cni/apply.py`` does for its state check) and compared, chain by chain, with what
``iptables-save`` prints in the pod's namespace, in the node's iptables backend.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from difflib import SequenceMatcher
from pathlib import Path

from istio_agent.cni.apply import ApplyError, expected_portion, installed_portion
from istio_agent.cni.capture_config import CaptureConfig
from istio_agent.cni.iptables import Backend, Tables, detect
from istio_agent.cni.netns import CommandError, Deadline, pod_ipv6
from istio_agent.cni.rules import build
from istio_agent.config.env import ConfigError


class CheckError(Exception):
    """The namespace could not be read (gone, no permission, no iptables)."""


@dataclass(frozen=True)
class Difference:
    """One rule that is expected but not installed (``missing``), installed but not expected
    (``unexpected``), or present in both but at another place in its chain (``misplaced``)."""

    kind: str
    family: str
    table: str
    chain: str
    rule: str


@dataclass(frozen=True)
class CheckReport:
    netns: Path
    backend: Backend
    families: tuple[str, ...]
    expected_rules: int
    installed_rules: int
    differences: tuple[Difference, ...]

    @property
    def matches(self) -> bool:
        return not self.differences


def pod_netns(target: str) -> Path:
    """A network namespace path, or a pid of a process in the pod (its ``/proc/<pid>/ns/net``)."""
    path = Path(f"/proc/{target}/ns/net") if target.isdigit() else Path(target)
    if not path.exists():
        detail = " (no such process)" if target.isdigit() else ""
        raise CheckError(f"{target}: no such network namespace{detail}")
    return path


def check_capture(
    config: CaptureConfig | None,
    netns: Path,
    *,
    deadline: float | None = None,
    backend: Backend | None = None,
    env: Mapping[str, str] | None = None,
) -> CheckReport:
    """The differences between ``config``'s rules and the Istio rules installed in ``netns``
    (``config`` None: the pod should have no Istio rules at all).

    IPv6 is decided from the namespace's addresses, as the plugin decides it (``config.enable_ipv6``
    is read as the proxy's dual-stack setting).
    """
    budget = Deadline(deadline)
    try:
        chosen = backend or detect(os.environ if env is None else env, deadline=budget)
        dual_stack = config is not None and config.enable_ipv6
        ipv6 = pod_ipv6(netns, dual_stack=dual_stack, deadline=budget)
        rules = build(replace(config, enable_ipv6=ipv6)) if config is not None else None
        families = ("v4", "v6") if ipv6 else ("v4",)
        differences: list[Difference] = []
        expected_count = installed_count = 0
        for family in families:
            planned = [] if rules is None else rules.v4 if family == "v4" else rules.v6
            expected = expected_portion(chosen, family, planned, deadline=budget)
            installed = installed_portion(chosen, family, netns=netns, deadline=budget, known=expected)
            expected_count += _count(expected)
            installed_count += _count(installed)
            differences += compare(family, expected, installed)
        if not ipv6:  # Istio rules in IPv6 of an IPv4 pod are leftovers too
            try:
                leftover = installed_portion(chosen, "v6", netns=netns, deadline=budget)
            except ApplyError:
                leftover = {}  # no ip6tables on this node: nothing can be installed there
            installed_count += _count(leftover)
            differences += compare("v6", {}, leftover)
    except (ApplyError, CommandError, ConfigError) as err:
        raise CheckError(str(err)) from None
    return CheckReport(netns, chosen, families, expected_count, installed_count, tuple(differences))


def compare(family: str, expected: Tables, installed: Tables) -> list[Difference]:
    """Chain by chain: missing and unexpected rules, and rules present in both but out of order.

    The two rule lists are aligned on their longest common subsequence (``difflib``): a rule left
    over on both sides is misplaced, on one side only missing or unexpected. Duplicates count: a
    rule installed twice where it is expected once is one unexpected copy (istio#49067's leftovers).
    """
    found: list[Difference] = []
    for table in sorted(set(expected) | set(installed)):
        want, have = expected.get(table, {}), installed.get(table, {})
        for chain in sorted(set(want) | set(have)):
            wanted, present = want.get(chain), have.get(chain)
            if present is None:
                found.append(Difference("missing-chain", family, table, chain, ""))
            elif wanted is None:
                found.append(Difference("unexpected-chain", family, table, chain, ""))
            found += _chain_differences(family, table, chain, wanted or [], present or [])
    return found


def _chain_differences(
    family: str, table: str, chain: str, wanted: list[str], present: list[str]
) -> list[Difference]:
    matcher = SequenceMatcher(None, wanted, present, autojunk=False)
    aligned_wanted: set[int] = set()
    aligned_present: set[int] = set()
    for start_wanted, start_present, size in matcher.get_matching_blocks():
        aligned_wanted.update(range(start_wanted, start_wanted + size))
        aligned_present.update(range(start_present, start_present + size))
    left_present = Counter(rule for at, rule in enumerate(present) if at not in aligned_present)
    found = []
    for at, rule in enumerate(wanted):
        if at in aligned_wanted:
            continue
        kind = "misplaced" if left_present[rule] > 0 else "missing"
        left_present[rule] -= 1
        found.append(Difference(kind, family, table, chain, rule))
    for at, rule in enumerate(present):
        if at not in aligned_present and left_present[rule] > 0:
            left_present[rule] -= 1
            found.append(Difference("unexpected", family, table, chain, rule))
    return found


def _count(tables: Tables) -> int:
    return sum(len(rules) for chains in tables.values() for rules in chains.values())
