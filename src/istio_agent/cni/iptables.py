"""The iptables backend: which binaries (legacy, nft or plain), and running save/restore with them.

The choice follows istio-iptables (``tools/istio-iptables/pkg/dependencies/implementation_linux.go``):
``FORCE_IPTABLES_BINARY`` wins; otherwise iptables-legacy when it is usable and already holds rules,
else iptables-nft, else plain ``iptables``. The caller decides *where* it detects: the plugin detects
in the node's namespace and uses the same backend inside every pod, so a pod never ends up with rules
in the other backend than the node's (istio#57827).

Writes inside a pod's namespace never take the node's xtables lock (``/run/xtables.lock``): the lock
file is the namespace itself (``XTABLES_LOCKFILE``, iptables >= 1.8.6), so pods only serialise with
their own namespace, never with kube-proxy on the host.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from istio_agent.cni.netns import NO_DEADLINE, CommandError, Deadline, NamespaceError, in_new_namespace, run
from istio_agent.config.env import ConfigError

FLAVORS = ("legacy", "nft", "")
"""Binary name infixes: ``iptables-legacy-save``, ``iptables-nft-save``, ``iptables-save``."""
Tables = dict[str, dict[str, list[str]]]
"""iptables-save parsed: table -> chain -> its rules (the text after ``-A CHAIN``), chains in order."""
LEGACY_WAIT_SECONDS = 30
"""istio-iptables' ``--wait`` for legacy writes; bounded here by the caller's deadline."""
_VERSION = re.compile(r"v(\d+(?:\.\d+)+)")


@dataclass(frozen=True)
class Version:
    """What ``<binary> --version`` says: ``iptables v1.8.9 (nf_tables)``."""

    numbers: tuple[int, ...]
    nft: bool


def parse_version(text: str) -> Version:
    """``iptables v1.8.7 (nf_tables)`` -> 1.8.7, nft; an unreadable version is an error."""
    match = _VERSION.search(text)
    if match is None:
        raise ValueError(f"no iptables version in {text.strip()!r}")
    return Version(tuple(int(part) for part in match.group(1).split(".")), "nf_tables" in text)


@dataclass(frozen=True)
class Backend:
    """One iptables flavour, for both families."""

    flavor: str
    version: Version

    def __str__(self) -> str:
        """``iptables-nft 1.8.9``, for the log."""
        return f"{self.binary('v4')} {'.'.join(map(str, self.version.numbers))}"

    def binary(self, family: str, tool: str = "") -> str:
        """``ip6tables-nft-restore`` for family v6, tool restore; tool "" is the command itself."""
        parts = ["iptables" if family == "v4" else "ip6tables", self.flavor, tool]
        return "-".join(part for part in parts if part)

    def save(self, family: str, *, netns: Path | None = None, deadline: Deadline = NO_DEADLINE) -> str:
        return run([self.binary(family, "save")], netns=netns, deadline=deadline)

    def restore(
        self,
        family: str,
        text: str,
        *,
        flush: bool = False,
        netns: Path | None = None,
        deadline: Deadline = NO_DEADLINE,
    ) -> None:
        """``<family>-restore`` the text; without ``flush`` (the default) only the lines given change."""
        argv = [self.binary(family, "restore"), *(() if flush else ("--noflush",))]
        if self.flavor == "legacy" or not self.version.nft:
            left = deadline.remaining(argv)
            wait = LEGACY_WAIT_SECONDS if left is None else max(1, min(LEGACY_WAIT_SECONDS, int(left)))
            argv.append(f"--wait={wait}")
        run(argv, netns=netns, stdin=text, env=lock_env(netns), deadline=deadline)

    def canonical(self, family: str, text: str, *, deadline: Deadline = NO_DEADLINE) -> str:
        """What iptables-save prints once ``text`` is restored into an empty namespace.

        The save form of a rule is the backend's own (``--dport 15008`` becomes ``-m tcp --dport
        15008``, marks turn hex); comparing installed rules with a config's rules needs both in that
        form. A throwaway namespace (``unshare(2)`` on a thread, ~3 ms with the two commands) gives it
        exactly, for any version.
        """
        env = {**os.environ, "XTABLES_LOCKFILE": "/proc/self/ns/net"}  # that namespace's own lock

        def restore_then_save() -> str:
            run([self.binary(family, "restore"), "--noflush"], stdin=text, env=env, deadline=deadline)
            return run([self.binary(family, "save")], env=env, deadline=deadline)

        try:
            return in_new_namespace(restore_then_save)
        except NamespaceError as err:
            raise CommandError([self.binary(family, "restore")], f"not run: {err}") from None


def lock_env(netns: Path | None) -> dict[str, str] | None:
    """The environment of a write: inside a pod's namespace, lock that namespace, not the node."""
    if netns is None:
        return None
    return {**os.environ, "XTABLES_LOCKFILE": str(netns)}


def probe(flavor: str, family: str = "v4", *, deadline: Deadline = NO_DEADLINE) -> Backend:
    """The backend if ``flavor``'s binaries run here (``<binary>-save --version``), with its version."""
    argv = [Backend(flavor, Version((), False)).binary(family, "save"), "--version"]
    try:
        return Backend(flavor, parse_version(run(argv, deadline=deadline)))
    except ValueError as err:
        raise CommandError(argv, str(err)) from None


def detect(env: Mapping[str, str], *, deadline: Deadline = NO_DEADLINE) -> Backend:
    """The backend for this node (the current network namespace), as istio-iptables chooses it."""
    forced = env.get("FORCE_IPTABLES_BINARY", "")
    if forced not in FLAVORS:
        raise ConfigError(f"invalid value {forced!r} for FORCE_IPTABLES_BINARY: must be legacy or nft")
    if forced:
        try:
            return probe(forced, deadline=deadline)
        except CommandError as err:
            raise ConfigError(f"FORCE_IPTABLES_BINARY={forced}, but it is not usable: {err}") from None
    problems = []
    for flavor in FLAVORS:
        try:
            if flavor == "legacy":
                saved = run(["iptables-legacy-save"], deadline=deadline)
                if len(saved.splitlines()) < 3:
                    continue  # usable, but the node's rules live elsewhere: nft, or plain iptables
            return probe(flavor, deadline=deadline)
        except CommandError as err:
            problems.append(str(err))
    raise ConfigError("no usable iptables binary: " + "; ".join(problems))


def parse_save(text: str) -> Tables:
    """iptables-save output as {table: {chain: [rule, ...]}}; chains declared without rules are kept."""
    tables: Tables = {}
    chains: dict[str, list[str]] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or line == "COMMIT":
            continue
        if line.startswith("*"):
            chains = tables.setdefault(line[1:].strip(), {})
        elif chains is None:
            raise ValueError(f"iptables-save line outside a table: {line!r}")
        elif line.startswith(":"):
            chains.setdefault(line[1:].split()[0], [])
        elif line.startswith("-A "):
            _, chain, *rest = line.split(" ", 2)
            chains.setdefault(chain, []).append(rest[0] if rest else "")
        else:
            raise ValueError(f"unexpected iptables-save line: {line!r}")
    return tables
