"""Applying the sidecar rule set in a network namespace: the one entry of the plugin and the CLI.

Compared with istio-iptables (``tools/istio-iptables/pkg/capture/run.go``, ``VerifyIptablesState``):

- the state check compares the installed Istio rules with the config's rules in iptables-save form
  (one throwaway namespace gives that form, see ``Backend.canonical``) instead of one ``iptables -C``
  per rule; an identical re-run executes no restore at all;
- a different config *replaces* the old Istio rules, where Istio (without ``--reconcile``) fails; the
  removal of the old rules and the new rules are one ``iptables-restore`` transaction per table, so
  there is no moment without capture and no need for Istio's temporary DROP guardrails;
- a failure rolls every family back to the rules it had before (the saved tables, restored as they
  were), so nothing is left half-applied, and the error names the command and its stderr.

What counts as Istio's in a namespace, as in Istio's cleanup: every ``ISTIO_*`` chain, the rules of
the built-in chains that jump to one, and the rules the config writes into built-in chains without a
jump (``-i/-o <iface> -j RETURN``, the TPROXY ``MARK``/``CONNMARK`` rules and the ``--mark`` RETURN),
each removed once however many copies there are. Anything else is someone else's (a VPN's CONNMARK,
a CNI's interface RETURN) and is never touched, even when it has the shape of an Istio rule. So a
config change that drops an interface exclusion leaves the old config's ``-i <iface> -j RETURN``
behind, as Istio does: cleaning up with the old flags (``--cleanup-only``) removes it.

Concurrent applies on one namespace take turns (:func:`istio_agent.cni.nslock.namespace_lock`):
check, write and roll back are one step, so a failing run never restores a snapshot over the rules
another run installed meanwhile.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

from istio_agent.cni import tproxy_routes
from istio_agent.cni.capture_config import CaptureConfig
from istio_agent.cni.iptables import Backend, Tables, detect, parse_save
from istio_agent.cni.netns import CommandError, Deadline
from istio_agent.cni.nslock import LockError, namespace_lock
from istio_agent.cni.rules import BUILTIN, Rule, RuleSet, build, render
from istio_agent.config.env import ConfigError
from istio_agent.logline import Scope

log = Scope("cni")
FAMILIES = ("v4", "v6")
ISTIO_PREFIX = "ISTIO_"
ROLLBACK_SECONDS = 5.0
"""Undoing a failed write gets its own budget: it must run even when the caller's is spent."""


class ApplyError(Exception):
    """Applying failed; the message names the failing command and its stderr, and the rollback."""


@dataclass(frozen=True)
class ApplyOutcome:
    """What happened: ``applied`` (fresh), ``unchanged`` (identical re-run: nothing executed),
    ``replaced`` (old Istio rules swapped for the config's), ``cleaned`` (cleanup-only removed them)
    or ``clean`` (cleanup-only found nothing)."""

    action: str
    backend: Backend
    saved: dict[str, str] = field(default_factory=dict)
    """iptables-save of each family afterwards, for the log (istio-iptables prints it at the end)."""

    @property
    def changed(self) -> bool:
        return self.action in ("applied", "replaced", "cleaned")


def apply_capture(
    config: CaptureConfig,
    *,
    netns: Path | None = None,
    cleanup_only: bool = False,
    deadline: float | None = None,
    backend: Backend | None = None,
    env: Mapping[str, str] | None = None,
    read_back: bool = True,
) -> ApplyOutcome:
    """Make ``netns`` (default: the current namespace) hold exactly the config's Istio rules.

    ``deadline`` is a ``time.monotonic()`` instant (the plugin's ADD deadline): every command gets
    only what is left of it. ``backend`` defaults to the one detected in the *current* namespace
    (the node's, for the plugin). IPv6 rules are written only when ``config.enable_ipv6``.
    ``read_back``: save the rules afterwards for the caller's log (``ApplyOutcome.saved``); the
    plugin, which logs none, spares its ADD those commands.
    """
    try:
        rules = build(config)
    except ConfigError as err:
        raise ApplyError(str(err)) from None

    def routes(action: str, budget: Deadline) -> None:
        tproxy_routes.follow_rules(config, action, cleanup_only=cleanup_only, netns=netns, deadline=budget)

    return apply_rule_set(
        rules,
        ipv6=config.enable_ipv6,
        netns=netns,
        cleanup_only=cleanup_only,
        deadline=deadline,
        backend=backend,
        env=env,
        read_back=read_back,
        after=routes,
    )


def apply_rule_set(
    rules: RuleSet,
    *,
    ipv6: bool,
    netns: Path | None = None,
    cleanup_only: bool = False,
    deadline: float | None = None,
    backend: Backend | None = None,
    env: Mapping[str, str] | None = None,
    read_back: bool = True,
    replace: bool = True,
    after: Callable[[str, Deadline], None] | None = None,
    prepare: Callable[[], None] | None = None,
) -> ApplyOutcome:
    """Make ``netns`` hold exactly ``rules`` as its Istio rules (any rule set of ``ISTIO_*`` chains:
    the sidecar capture, ambient's in-pod or host rules); :func:`apply_capture`'s arguments.

    ``replace=False``: other Istio rules in place are an ApplyError instead of being replaced
    (nothing is written). ``after(action, deadline)`` runs once the rules are in place, under the
    namespace's lock (routes that go with the rules); a CommandError from it puts the rules back as
    they were. ``prepare`` makes, in the empty namespace where the rules are tried out, what they
    refer to besides themselves (an ipset).
    """
    budget = Deadline(deadline)
    try:
        chosen = backend or detect(os.environ if env is None else env, deadline=budget)
    except (CommandError, ConfigError) as err:
        raise ApplyError(str(err)) from None
    known = {"v4": rules.v4, "v6": rules.v6}
    planned = {"v4": rules.v4, "v6": rules.v6 if ipv6 else []}
    if cleanup_only:
        planned = {"v4": [], "v6": []}
    applier = _Applier(chosen, netns, budget, replace=replace, prepare=prepare)
    try:
        with namespace_lock(netns, budget):
            return _apply_locked(applier, ipv6, planned, known, cleanup_only, read_back, after)
    except LockError as err:
        raise ApplyError(str(err)) from None


def _apply_locked(
    applier: _Applier,
    ipv6: bool,
    planned: dict[str, list[Rule]],
    known: dict[str, list[Rule]],
    cleanup_only: bool,
    read_back: bool,
    after: Callable[[str, Deadline], None] | None,
) -> ApplyOutcome:
    """The rules, then what follows them (the TPROXY routing), with the namespace's lock held."""
    action = applier.rules(planned, known, cleanup_only=cleanup_only)
    try:
        if after is not None:
            after(action, applier.deadline)
    except CommandError as err:
        if action in ("unchanged", "clean"):  # nothing written: nothing to put back
            raise ApplyError(str(err)) from None
        raise ApplyError(applier.roll_back(err)) from None
    families = ("v4", "v6") if ipv6 else ("v4",)
    saved = {}
    for family in (f for f in families if read_back and f in applier.before):
        try:
            saved[family] = applier.backend.save(family, netns=applier.netns, deadline=applier.deadline)
        except CommandError as err:
            log.warning("could not read back the rules: %s", err)
    return ApplyOutcome(action, applier.backend, saved)


def expected_portion(
    backend: Backend,
    family: str,
    rules: list[Rule],
    *,
    deadline: Deadline,
    prepare: Callable[[], None] | None = None,
) -> Tables:
    """The Istio portion ``rules`` give once installed, in ``backend``'s iptables-save form.

    ``prepare``: run first in the empty namespace that gives the form (see ``Backend.canonical``).
    """
    if not rules:
        return {}
    try:
        canonical = backend.canonical(family, render(rules), deadline=deadline, prepare=prepare)
    except CommandError as err:
        restore = backend.binary(family, "restore")
        raise ApplyError(
            f"{restore} refuses the rules (tried in an empty network namespace, nothing was"
            f" changed): {err.stderr or err.problem}"
        ) from None
    parsed = _parse(canonical)
    return istio_portion(parsed, parsed)  # an empty namespace: every rule in it is the config's


def installed_portion(
    backend: Backend, family: str, *, netns: Path | None, deadline: Deadline, known: Tables | None = None
) -> Tables:
    """The Istio portion installed in ``netns`` (iptables-save form); raises ApplyError.

    ``known``: the config's own portion (:func:`expected_portion`), whose rules without a jump count
    as Istio's where they are found in built-in chains.
    """
    try:
        return istio_portion(_parse(backend.save(family, netns=netns, deadline=deadline)), known)
    except CommandError as err:
        raise ApplyError(str(err)) from None


def istio_portion(tables: Tables, known: Tables | None = None) -> Tables:
    """Only Istio's part of a parsed save: its ``ISTIO_*`` chains whole and, in the built-in chains,
    the rules that jump to one, plus each rule of ``known``'s built-in chains found there (once per
    copy in ``known``: a second, foreign copy of the same rule is not Istio's)."""
    portion: Tables = {}
    for table, chains in tables.items():
        for chain, rules in chains.items():
            if chain.startswith(ISTIO_PREFIX):
                portion.setdefault(table, {})[chain] = list(rules)
            elif chain in BUILTIN:
                expected = Counter((known or {}).get(table, {}).get(chain, ()))
                owned = []
                for rule in rules:
                    if jumps_to_istio(rule):
                        owned.append(rule)
                    elif expected[rule] > 0:
                        expected[rule] -= 1
                        owned.append(rule)
                if owned:
                    portion.setdefault(table, {})[chain] = owned
    return portion


def jumps_to_istio(rule: str) -> bool:
    """Whether a rule (iptables-save form) jumps to one of Istio's chains."""
    pairs = pairwise(rule.split())
    return any(flag in ("-j", "-g") and target.startswith(ISTIO_PREFIX) for flag, target in pairs)


def removal(portion: Mapping[str, list[str]]) -> list[str]:
    """restore lines taking one table's Istio portion away: its rules in built-ins, then its chains."""
    lines = [f"-D {chain} {rule}" for chain, rules in portion.items() if chain in BUILTIN for rule in rules]
    istio = [chain for chain in portion if chain.startswith(ISTIO_PREFIX)]
    lines += [f"-F {chain}" for chain in istio]
    lines += [f"-X {chain}" for chain in istio]
    return lines


def _parse(saved: str) -> Tables:
    try:
        return parse_save(saved)
    except ValueError as err:
        raise ApplyError(f"cannot read the iptables-save output: {err}") from None


def _table_blocks(rules: list[Rule]) -> dict[str, list[str]]:
    """The rendered restore lines of each table, without the ``*table`` and ``COMMIT`` lines."""
    blocks = {}
    for table in sorted({rule.table for rule in rules}):
        lines = render([rule for rule in rules if rule.table == table]).splitlines()
        blocks[table] = lines[1:-1]
    return blocks


def _saved_tables(text: str, tables: set[str]) -> str:
    """The given tables of an iptables-save output, as restore input; absent tables come back empty."""
    out: list[str] = []
    current: str | None = None
    for line in text.splitlines():
        if line.startswith("*"):
            current = line[1:].strip()
        if current in tables and not line.startswith("#"):
            out.append(line)
        if line.strip() == "COMMIT":
            current = None
    present = {line[1:].strip() for line in out if line.startswith("*")}
    for table in sorted(tables - present):
        out += [f"*{table}", "COMMIT"]
    return "".join(f"{line}\n" for line in out)


class _Applier:
    """One apply: the state before, the writes made so far, and how to undo them."""

    def __init__(
        self,
        backend: Backend,
        netns: Path | None,
        deadline: Deadline,
        *,
        replace: bool = True,
        prepare: Callable[[], None] | None = None,
    ) -> None:
        self.backend = backend
        self.netns = netns
        self.deadline = deadline
        self.replace = replace
        self.prepare = prepare
        self.before: dict[str, str] = {}
        self.touched: dict[str, set[str]] = {}

    def rules(
        self, planned: dict[str, list[Rule]], known: dict[str, list[Rule]], *, cleanup_only: bool
    ) -> str:
        """Write what differs; returns the action (see ApplyOutcome).

        ``known``: the config's rules of each family, written or not (IPv6 off, cleanup-only): their
        rules without a jump are the only such rules of built-in chains that count as Istio's.
        """
        for family in FAMILIES:
            try:
                self.before[family] = self.backend.save(family, netns=self.netns, deadline=self.deadline)
            except CommandError as err:
                if family == "v4" or planned[family]:  # v6 may be missing on an IPv4-only node
                    raise ApplyError(str(err)) from None
                log.info("skipping %s: %s", family, err)
        present = {family: _parse(self.before[family]) for family in self.before}
        if not any(istio_portion(tables) for tables in present.values()):  # no ISTIO_ chain, no jump
            if cleanup_only:
                return "clean"
            for family in self.before:
                if planned[family]:
                    self._write(family, _table_blocks(planned[family]), {})
            return "applied"
        differing: dict[str, Tables] = {}
        for family in self.before:
            expected = expected_portion(
                self.backend, family, planned[family], deadline=self.deadline, prepare=self.prepare
            )
            current: Tables = {}
            if istio_portion(present[family]):  # a family without Istio chains holds nothing of Istio's
                ours = expected
                if known[family] != planned[family]:
                    ours = expected_portion(
                        self.backend, family, known[family], deadline=self.deadline, prepare=self.prepare
                    )
                current = istio_portion(present[family], ours)
            if expected != current:
                differing[family] = current
        if not self.replace and not cleanup_only and any(differing.values()):
            tables = sorted({f"{family} {table}" for family, old in differing.items() for table in old})
            raise ApplyError(
                f"other Istio rules are in place ({', '.join(tables)}) and reconciling is off: left as they are"
            )
        for family, current in differing.items():
            self._write(family, _table_blocks(planned[family]), current)
        if not differing:
            return "unchanged"
        return "cleaned" if cleanup_only else "replaced"

    def _write(self, family: str, blocks: dict[str, list[str]], old: Tables) -> None:
        """One restore per family: per table, the old Istio portion out and the new rules in."""
        lines = []
        for table in sorted(set(blocks) | set(old)):
            lines += [f"*{table}", *removal(old.get(table, {})), *blocks.get(table, []), "COMMIT"]
        self.touched[family] = set(blocks) | set(old)
        try:
            self.backend.restore(
                family, "".join(f"{line}\n" for line in lines), netns=self.netns, deadline=self.deadline
            )
        except CommandError as err:
            raise ApplyError(self.roll_back(err)) from None

    def roll_back(self, cause: CommandError) -> str:
        """Restore every table written so far as it was; the message for the error to raise."""
        problems = []
        grace = Deadline.after(ROLLBACK_SECONDS)
        for family, tables in self.touched.items():
            text = _saved_tables(self.before[family], tables)
            try:
                self.backend.restore(family, text, flush=True, netns=self.netns, deadline=grace)
            except CommandError as err:
                problems.append(str(err))
        if problems:
            return f"{cause}; rolling back failed too: {'; '.join(problems)}"
        return f"{cause}; the rules before were restored"
