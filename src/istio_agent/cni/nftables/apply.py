"""Applying the nftables rule set in a network namespace, idempotently and atomically.

Istio (``tools/istio-nftables/pkg/capture/run.go``, ``executeCommands``) sends its transaction to
``nft -f -`` every time: each Istio table that gets rules is added, flushed and filled. Here:

- the Istio tables a namespace holds are read first (``nft -s list ruleset inet``: the rules without
  their counters); with none, the transaction is Istio's, unchanged;
- with some, the config's tables are put in that same listing form by applying the transaction in a
  throwaway namespace (``unshare(2)`` on a thread), and compared: identical, nothing is executed
  (the counters keep counting); different, one ``nft -f`` transaction deletes the Istio tables
  present and adds the config's, so a chain or a whole table the new config no longer has (the
  mangle table after TPROXY -> REDIRECT) does not linger, and there is no moment without capture;
- ``cleanup_only`` deletes the Istio tables present (Istio: ``add table``, ``delete table`` for all
  three) and the TPROXY routing;
- only ``inet istio-proxy-nat``, ``istio-proxy-mangle`` and ``istio-proxy-raw`` are ever touched.

An ``nft -f`` file is one kernel transaction, so a refused rule set changes nothing. The TPROXY
routing comes after (``cni/tproxy_routes.py``, as ``ProgramNftables`` configures routes after the
rules); when it fails, the Istio tables are put back as they were, in one more transaction.
Concurrent applies on a namespace take turns on the lock the iptables path uses (``cni/nslock.py``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from istio_agent.cni import tproxy_routes
from istio_agent.cni.apply import ApplyError
from istio_agent.cni.capture_config import CaptureConfig
from istio_agent.cni.netns import CommandError, Deadline, NamespaceError, in_new_namespace, run
from istio_agent.cni.nftables.builder import TABLES, render_config
from istio_agent.cni.nslock import LockError, namespace_lock
from istio_agent.config.env import ConfigError
from istio_agent.logline import Scope

log = Scope("cni")
ROLLBACK_SECONDS = 5.0
"""Putting the tables back after a failed step gets its own budget: the caller's may be spent."""
MISSING_NFT = "nativeNftables is enabled, but the nft binary is missing"
"""Istio's words (``NewNftablesConfigurator``) for a node or image without ``nft``."""


@dataclass(frozen=True)
class NftOutcome:
    """What happened, in :class:`istio_agent.cni.apply.ApplyOutcome`'s words: ``applied``,
    ``unchanged``, ``replaced``, ``cleaned`` or ``clean``."""

    action: str
    nft: str
    """The ``nft`` binary used."""
    ruleset: str = ""
    """Istio's tables afterwards, with their counters (``nft list``), for the log; "" without read-back."""

    @property
    def changed(self) -> bool:
        return self.action in ("applied", "replaced", "cleaned")


def apply_nft_capture(
    config: CaptureConfig,
    *,
    netns: Path | None = None,
    cleanup_only: bool = False,
    deadline: float | None = None,
    read_back: bool = True,
    env: Mapping[str, str] | None = None,
) -> NftOutcome:
    """Make ``netns`` (default: the current namespace) hold exactly the config's Istio tables.

    ``deadline`` is a ``time.monotonic()`` instant shared by every command (the plugin's ADD
    deadline). ``read_back``: list the tables afterwards for the caller's log. ``env``: where
    ``PATH`` is looked up for ``nft`` (default: this process's). Raises ApplyError.
    """
    try:
        wanted = "" if cleanup_only else render_config(config)
    except ConfigError as err:
        raise ApplyError(str(err)) from None

    def routes(action: str, budget: Deadline) -> None:
        tproxy_routes.follow_rules(config, action, cleanup_only=cleanup_only, netns=netns, deadline=budget)

    return apply_nft_tables(
        wanted,
        tables=TABLES,
        netns=netns,
        cleanup_only=cleanup_only,
        deadline=deadline,
        read_back=read_back,
        env=env,
        after=routes,
    )


def apply_nft_tables(
    wanted: str,
    *,
    tables: tuple[str, ...],
    netns: Path | None = None,
    cleanup_only: bool = False,
    deadline: float | None = None,
    read_back: bool = True,
    env: Mapping[str, str] | None = None,
    after: Callable[[str, Deadline], None] | None = None,
) -> NftOutcome:
    """Make ``netns`` hold exactly the ``inet`` tables named in ``tables`` that the ``wanted``
    transaction makes (any Istio rule set: the sidecar capture, ambient's in-pod rules); the
    arguments of :func:`apply_nft_capture`. Only the tables named are read, compared or deleted.
    ``after(action, deadline)`` runs once they are in place, under the namespace's lock; a
    CommandError from it puts the tables back as they were.
    """
    budget = Deadline(deadline)
    path = (os.environ if env is None else env).get("PATH", os.defpath)
    nft = shutil.which("nft", path=path)
    if nft is None:
        raise ApplyError(f"{MISSING_NFT}: no nft in PATH ({path})")
    applier = _Applier(nft, netns, budget, tables)
    try:
        with namespace_lock(netns, budget):
            return applier.apply(wanted, after, cleanup_only=cleanup_only, read_back=read_back)
    except LockError as err:
        raise ApplyError(str(err)) from None
    except CommandError as err:
        raise ApplyError(str(err)) from None


def istio_tables(listing: str, names: Iterable[str] = TABLES) -> dict[str, str]:
    """The Istio tables (``names``) of an ``nft list ruleset`` output: name -> its whole block, as listed."""
    wanted = set(names)
    tables: dict[str, str] = {}
    name: str | None = None
    block: list[str] = []
    for line in listing.splitlines():
        if name is None:
            words = line.split()
            if len(words) == 4 and words[:2] == ["table", "inet"] and words[2] in wanted and words[3] == "{":
                name, block = words[2], [line]
            continue
        block.append(line)
        if line == "}":
            tables[name] = "".join(f"{text}\n" for text in block)
            name = None
    return tables


def deletions(tables: Iterable[str]) -> str:
    """``delete table`` lines for the given Istio tables."""
    return "".join(f"delete table inet {name}\n" for name in tables)


class _Applier:
    """One apply: the tables before, and how to put them back."""

    def __init__(self, nft: str, netns: Path | None, deadline: Deadline, tables: tuple[str, ...]) -> None:
        self.nft = nft
        self.netns = netns
        self.deadline = deadline
        self.tables = tables
        self.before: dict[str, str] = {}

    def apply(
        self,
        wanted: str,
        after: Callable[[str, Deadline], None] | None,
        *,
        cleanup_only: bool,
        read_back: bool,
    ) -> NftOutcome:
        self.before = istio_tables(self._list(stateless=True), self.tables)
        action = self._rules(wanted, cleanup_only=cleanup_only)
        if after is not None:
            self._after(after, action)
        ruleset = ""
        if read_back:
            try:
                ruleset = "".join(istio_tables(self._list(stateless=False), self.tables).values())
            except CommandError as err:
                log.warning("could not read back the nftables rules: %s", err)
        return NftOutcome(action, self.nft, ruleset)

    def _rules(self, wanted: str, *, cleanup_only: bool) -> str:
        """Write what differs; returns the action."""
        if cleanup_only:
            if not self.before:
                return "clean"
            self._run(deletions(self.before))
            return "cleaned"
        if not self.before:
            self._run(wanted)
            return "applied"
        if self._canonical(wanted) == self.before:
            return "unchanged"
        self._run(deletions(self.before) + wanted)
        return "replaced"

    def _after(self, after: Callable[[str, Deadline], None], action: str) -> None:
        """What follows the rules (the TPROXY routing, ``::6`` on lo), as Istio orders it."""
        try:
            after(action, self.deadline)
        except CommandError as err:
            if action in ("unchanged", "clean"):
                raise
            raise ApplyError(self._roll_back(err)) from None

    def _roll_back(self, cause: CommandError) -> str:
        """Put the Istio tables back as they were; the message for the error to raise."""
        grace = Deadline.after(ROLLBACK_SECONDS)
        try:
            now = istio_tables(self._list(stateless=True, deadline=grace), self.tables)
            self._run(deletions(now) + "".join(self.before.values()), deadline=grace)
        except CommandError as err:
            return f"{cause}; putting the nftables rules back failed too: {err}"
        return f"{cause}; the nftables rules before were put back"

    def _list(self, *, stateless: bool, deadline: Deadline | None = None) -> str:
        argv = [self.nft, *(("-s",) if stateless else ()), "list", "ruleset", "inet"]
        return run(argv, netns=self.netns, deadline=deadline or self.deadline)

    def _run(self, transaction: str, *, deadline: Deadline | None = None) -> None:
        """One ``nft -f -`` transaction in the namespace: all of it applies, or none."""
        if transaction:
            budget = deadline or self.deadline
            run([self.nft, "-f", "-"], netns=self.netns, stdin=transaction, deadline=budget)

    def _canonical(self, wanted: str) -> dict[str, str]:
        """The config's Istio tables as ``nft -s list`` prints them, from an empty namespace."""

        def apply_then_list() -> str:
            run([self.nft, "-f", "-"], stdin=wanted, deadline=self.deadline)
            return run([self.nft, "-s", "list", "ruleset", "inet"], deadline=self.deadline)

        try:
            return istio_tables(in_new_namespace(apply_then_list), self.tables)
        except NamespaceError as err:
            raise CommandError([self.nft, "-f", "-"], f"not run: {err}") from None
        except CommandError as err:
            raise ApplyError(
                f"nft refuses the rules (tried in an empty network namespace, nothing was changed): "
                f"{err.stderr or err.problem}"
            ) from None
