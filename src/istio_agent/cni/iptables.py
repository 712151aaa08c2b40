"""The iptables backend: which binaries (legacy, nft or plain), and running save/restore with them.

The choice follows istio-iptables (``tools/istio-iptables/pkg/dependencies/implementation_linux.go``):
``FORCE_IPTABLES_BINARY`` wins; otherwise iptables-legacy when it is usable and already holds rules,
else iptables-nft, else plain ``iptables``. The caller decides *where* it detects: the plugin detects
in the node's namespace and uses the same backend inside every pod, so a pod never ends up with rules
in the other backend than the node's (istio#57827).

Writes inside a pod's namespace never take the node's xtables lock (``/run/xtables.lock``): the lock
file is the namespace itself, so pods only serialise with their own namespace, never with kube-proxy
on the host. As in Istio's CNI mode (``dependencies/implementation_linux.go``), by version of legacy
iptables (nf_tables never locks): from 1.8.6 ``XTABLES_LOCKFILE=<netns>``; from 1.6.2 to 1.8.5, which
ignore that variable, the write runs in a private mount namespace where the netns file is
bind-mounted over ``/run/xtables.lock``; below 1.6.2 ``iptables-restore`` neither locks nor knows
``--wait``. A binary whose ``-save --version`` fails (1.6.1 has no such option) is taken for such an
old legacy one.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from istio_agent.cni.netns import (
    NO_DEADLINE,
    CommandError,
    Deadline,
    NamespaceError,
    in_namespace,
    in_new_namespace,
    run,
)
from istio_agent.config.env import ConfigError
from istio_agent.logline import Scope

FLAVORS = ("legacy", "nft", "")
"""Binary name infixes: ``iptables-legacy-save``, ``iptables-nft-save``, ``iptables-save``."""
Tables = dict[str, dict[str, list[str]]]
"""iptables-save parsed: table -> chain -> its rules (the text after ``-A CHAIN``), chains in order."""
LEGACY_WAIT_SECONDS = 30
"""istio-iptables' ``--wait`` for legacy writes; bounded here by the caller's deadline."""
RESTORE_LOCKING = (1, 6, 2)
"""From this legacy version on, iptables-restore takes the xtables lock and knows ``--wait``."""
LOCKFILE_ENV = (1, 8, 6)
"""From this legacy version on, ``XTABLES_LOCKFILE`` names the lock file."""
NODE_LOCK = Path("/run/xtables.lock")
"""The lock file of iptables before 1.8.6 (and the default after): the node's, shared with kube-proxy."""
_VERSION = re.compile(r"v(\d+(?:\.\d+)+)")
log = Scope("cni")


@dataclass(frozen=True)
class Version:
    """What ``<binary> --version`` says: ``iptables v1.8.9 (nf_tables)``."""

    numbers: tuple[int, ...]
    nft: bool


UNKNOWN = Version((0, 0, 0), nft=False)
"""A binary that does not report its version: a legacy one older than 1.6.2, as Istio assumes."""


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
    pod_lock: bool = False
    """Writes in the current namespace lock that namespace, not the node (``--cni-mode``); a write
    into another namespace (``netns=``) always locks that one."""

    def __str__(self) -> str:
        """``iptables-nft 1.8.9``, for the log."""
        if self.version == UNKNOWN:
            return f"{self.binary('v4')} (version unknown)"
        return f"{self.binary('v4')} {'.'.join(map(str, self.version.numbers))}"

    @property
    def locks(self) -> bool:
        """Whether a restore takes the xtables lock (and takes ``--wait``): legacy from 1.6.2."""
        return not self.version.nft and self.version.numbers >= RESTORE_LOCKING

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
        """``<family>-restore`` the text; without ``flush`` (the default) only the lines given change.

        The lock it takes is the module docstring's: the namespace's own when writing into ``netns``
        (or with ``pod_lock``), else the default one, which inside a pod's container is the pod's.
        """
        argv = [self.binary(family, "restore"), *(() if flush else ("--noflush",))]
        if not self.locks:
            run(argv, netns=netns, stdin=text, deadline=deadline)
            return
        left = deadline.remaining(argv)
        wait = LEGACY_WAIT_SECONDS if left is None else max(1, min(LEGACY_WAIT_SECONDS, int(left)))
        argv.append(f"--wait={wait}")
        if netns is None and not self.pod_lock:
            run(argv, stdin=text, deadline=deadline)
        elif self.version.numbers >= LOCKFILE_ENV:
            run(argv, netns=netns, stdin=text, env=lock_env(netns), deadline=deadline)
        else:
            self._run_with_namespace_lock(argv, netns, stdin=text, deadline=deadline)

    def thread_lock(self) -> dict[str, str] | None:
        """For a short-lived thread inside a namespace: the environment of the writes it starts
        (None: this process's), so that they lock that namespace, never the node.

        From 1.8.6 that is ``XTABLES_LOCKFILE``. Before (the variable is ignored) the thread gets a
        private mount namespace with its netns file over ``/run/xtables.lock``
        (:func:`private_xtables_lock`); when that is refused (no CAP_SYS_ADMIN, an LSM), the writes
        take the node's lock, as Istio falls back: slower under contention, never wrong.
        """
        if not self.locks:
            return None
        if self.version.numbers >= LOCKFILE_ENV:
            return lock_env(None)
        try:
            private_xtables_lock(Path("/proc/thread-self/ns/net"))
        except OSError as err:
            log.warning("writing with the node's xtables lock: %s", err)
        return None

    def _run_with_namespace_lock(
        self, argv: list[str], netns: Path | None, *, stdin: str, deadline: Deadline
    ) -> None:
        """A write that must lock ``netns`` (None: the calling thread's namespace) from a thread of
        its own in that namespace (:meth:`thread_lock` changes that thread for good)."""
        here = Path(f"/proc/self/task/{threading.get_native_id()}/ns/net")

        def step() -> None:
            run(argv, stdin=stdin, env=self.thread_lock(), deadline=deadline)  # on this thread

        try:
            in_namespace(netns or here, step)
        except NamespaceError as err:
            raise CommandError(argv, f"not run: {err}") from None

    def canonical(
        self,
        family: str,
        text: str,
        *,
        deadline: Deadline = NO_DEADLINE,
        prepare: Callable[[], None] | None = None,
    ) -> str:
        """What iptables-save prints once ``text`` is restored into an empty namespace.

        The save form of a rule is the backend's own (``--dport 15008`` becomes ``-m tcp --dport
        15008``, marks turn hex); comparing installed rules with a config's rules needs both in that
        form. A throwaway namespace (``unshare(2)`` on a thread, ~3 ms with the two commands) gives it
        exactly, for any version. ``prepare`` runs there first, on the same thread: what the rules
        need besides themselves (the ipset a ``--match-set`` names).
        """

        def restore_then_save() -> str:
            if prepare is not None:
                prepare()
            env = self.thread_lock()  # that namespace's own lock, never the node's (any version)
            run([self.binary(family, "restore"), "--noflush"], stdin=text, env=env, deadline=deadline)
            return run([self.binary(family, "save")], env=env, deadline=deadline)

        try:
            return in_new_namespace(restore_then_save)
        except NamespaceError as err:
            raise CommandError([self.binary(family, "restore")], f"not run: {err}") from None


def lock_env(netns: Path | None) -> dict[str, str]:
    """The environment of a write (iptables >= 1.8.6) that locks its namespace, not the node:
    ``netns``, or the writer's own (``/proc/self`` is the iptables process)."""
    return {**os.environ, "XTABLES_LOCKFILE": str(netns or "/proc/self/ns/net")}


CLONE_NEWNS = 0x00020000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000


def private_xtables_lock(lock: Path) -> None:
    """Give the calling thread (only it; a thread started for that, never a long-lived one) a mount
    namespace of its own in which ``/run/xtables.lock`` is ``lock``. Commands it starts then lock
    ``lock`` where they would lock the node. Raises OSError.

    The node's lock file is created when missing (iptables would create it anyway): a bind mount
    needs a file to cover.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p)

    def check(result: int, what: str) -> None:
        if result != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"{what}: {os.strerror(code)}")

    check(libc.unshare(CLONE_NEWNS), "cannot make a mount namespace")
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "cannot make / private")
    os.close(os.open(NODE_LOCK, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
    check(libc.mount(os.fsencode(lock), os.fsencode(NODE_LOCK), None, MS_BIND, None), f"cannot mount {lock}")


def probe(
    flavor: str, family: str = "v4", *, deadline: Deadline = NO_DEADLINE, runs: bool = False
) -> Backend:
    """The backend if ``flavor``'s binaries run here (``<binary>-save --version``), with its version.

    A save binary that runs but reports no version (1.6.1 has no ``--version``: it warns and dumps
    the rules) is a legacy one of unknown version, as Istio takes it (:data:`UNKNOWN`). ``runs``:
    the caller already saw the save binary run.
    """
    save = Backend(flavor, UNKNOWN).binary(family, "save")
    try:
        text = run([save, "--version"], deadline=deadline)
    except CommandError:
        if not runs:
            run([save], deadline=deadline)  # raises: the binary is missing or broken
        text = ""
    if _VERSION.search(text):
        return Backend(flavor, parse_version(text))
    log.warning(
        "%s reports no version: taken for a legacy iptables older than 1.6.2 (no lock, no --wait)", save
    )
    return Backend(flavor, UNKNOWN)


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
                return probe(flavor, deadline=deadline, runs=True)
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
