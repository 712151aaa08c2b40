"""Old legacy iptables, as Istio handles them (``tools/istio-iptables/pkg/dependencies``): below 1.8.6
``XTABLES_LOCKFILE`` is ignored, below 1.6.2 ``iptables-restore`` neither locks nor knows ``--wait``,
and 1.6.1's ``iptables-save`` has no ``--version``.

Stub ``iptables-legacy-save``/``-restore`` first on ``PATH`` play those versions: they report the
version, record how each restore is run (its arguments, ``XTABLES_LOCKFILE``, and which file
``/run/xtables.lock`` is where it runs), behave as that version would (ignore the variable, refuse
``--wait``, take no lock), then run the real iptables-legacy, in a network namespace of the test's.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from istio_agent.cni.apply import apply_capture
from istio_agent.cni.capture_config import CaptureConfig
from istio_agent.cni.iptables import NODE_LOCK, UNKNOWN, Backend, Version, probe
from istio_agent.cni.netns import Deadline, in_namespace
from tests.cni.netns import Netns, needs_root, netns

REAL = shutil.which("iptables-legacy-restore")
pytestmark = [
    needs_root,
    pytest.mark.skipif(REAL is None, reason="needs iptables-legacy (Debian's iptables package)"),
]
ISTIO_INIT = CaptureConfig(inbound_ports=("*",), inbound_ports_exclude=(15020,), ip_ranges_include=("*",))
HOLD_SECONDS = 3.0
"""The time budget of a write while the test holds the node's lock: waiting for it would exhaust it."""

SAVE = """#!/bin/sh
# iptables-legacy-save of version {version}: answers --version as that version does
if [ "$1" = "--version" ]; then
{answer}
fi
exec {real_dir}/iptables-legacy-save "$@"
"""
VERSION_ANSWER = '  echo "iptables-save v{version} (legacy)"; exit 0'
NO_VERSION_ANSWER = """  echo "iptables-save: unrecognized option '--version'" >&2
  exec {real_dir}/iptables-legacy-save"""  # 1.6.1 (Ubuntu bionic): a warning, the rules, exit 0
RESTORE = """#!/bin/sh
# iptables-legacy-restore of version {version}: records how it runs, then behaves as that version
printf '%s|%s|%s\\n' "$*" "${{XTABLES_LOCKFILE-unset}}" "$(stat -L -c %d:%i /run/xtables.lock)" >> {log}
{behaviour}
exec {real_dir}/iptables-legacy-restore "$@"
"""
IGNORES_LOCKFILE = "unset XTABLES_LOCKFILE  # before 1.8.6"
NO_LOCKING = """case "$*" in *--wait*) echo "iptables-restore: unrecognized option '--wait'" >&2; exit 2;; esac
export XTABLES_LOCKFILE={own}  # before 1.6.2 restore takes no lock: a file nobody else locks"""


@dataclass(frozen=True)
class Restore:
    """One run of the stub restore."""

    argv: str
    lockfile_env: str
    lock_file: str
    """``device:inode`` of what ``/run/xtables.lock`` was where the restore ran."""


@dataclass(frozen=True)
class Stubs:
    log: Path

    def restores(self) -> list[Restore]:
        if not self.log.exists():
            return []
        return [Restore(*line.split("|")) for line in self.log.read_text().splitlines()]


StubsFor = Callable[[str | None], Stubs]


def identity(path: Path) -> str:
    info = os.stat(path)
    return f"{info.st_dev}:{info.st_ino}"


@pytest.fixture
def stubs_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StubsFor]:
    """``stubs_for(version)`` puts stubs of that version (None: no ``--version``) first on PATH."""
    assert REAL is not None
    real_dir = str(Path(REAL).parent)
    log = tmp_path / "restores.log"

    def make(version: str | None) -> Stubs:
        numbers = tuple(int(part) for part in version.split(".")) if version else (0,)
        answer = (VERSION_ANSWER if version else NO_VERSION_ANSWER).format(version=version, real_dir=real_dir)
        if numbers < (1, 6, 2):
            behaviour = NO_LOCKING.format(own=tmp_path / "own.lock")
        else:
            behaviour = IGNORES_LOCKFILE
        files = {
            "iptables-legacy-save": SAVE.format(version=version, answer=answer, real_dir=real_dir),
            "iptables-legacy-restore": RESTORE.format(
                version=version, log=log, behaviour=behaviour, real_dir=real_dir
            ),
        }
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for name, text in files.items():
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(stat.S_IRWXU)
        monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
        return Stubs(log)

    yield make


@pytest.fixture
def pod() -> Iterator[Netns]:
    with netns() as space:
        yield space


@contextmanager
def node_lock_held() -> Iterator[None]:
    """The node's xtables lock taken, as kube-proxy holds it while it syncs."""
    with NODE_LOCK.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def istio_chains(pod: Netns) -> bool:
    return ":ISTIO_INBOUND" in pod.exec(str(REAL).replace("-restore", "-save"))


def test_1_8_4_writes_lock_the_pods_namespace_through_a_private_mount(
    stubs_for: StubsFor, pod: Netns
) -> None:
    """Before 1.8.6 XTABLES_LOCKFILE is ignored: setting it left pods contending on the node's lock."""
    stubs = stubs_for("1.8.4")
    backend = probe("legacy")
    assert backend == Backend("legacy", Version((1, 8, 4), False))
    started = time.monotonic()
    with node_lock_held():
        apply_capture(ISTIO_INIT, netns=pod.path, backend=backend, deadline=Deadline.after(HOLD_SECONDS).at)
    assert time.monotonic() - started < HOLD_SECONDS - 1
    assert istio_chains(pod)
    [restore] = stubs.restores()
    assert restore.argv.split()[0] == "--noflush"
    assert restore.argv.split()[1].startswith("--wait=")
    assert restore.lock_file == identity(pod.path)  # /run/xtables.lock was the pod's netns file there
    assert restore.lockfile_env == "unset"
    assert identity(NODE_LOCK) != identity(pod.path)  # and nowhere else: the mount was private


@pytest.mark.parametrize("version", ["1.6.1", None], ids=["1.6.1", "no-version"])
def test_before_1_6_2_restores_run_without_wait_or_lock(
    stubs_for: StubsFor, pod: Netns, version: str | None
) -> None:
    """1.6.1's iptables-restore refuses --wait (every write failed); its save has no --version."""
    stubs = stubs_for(version)
    backend = probe("legacy")
    with node_lock_held():
        apply_capture(ISTIO_INIT, netns=pod.path, backend=backend, deadline=Deadline.after(HOLD_SECONDS).at)
    assert istio_chains(pod)
    assert backend.version == (UNKNOWN if version is None else Version((1, 6, 1), False))
    assert not backend.locks
    [restore] = stubs.restores()
    assert restore.argv == "--noflush"
    assert restore.lockfile_env == "unset"
    assert restore.lock_file == identity(NODE_LOCK)  # nothing mounted: there is no lock to move


def test_a_save_binary_that_does_not_run_is_not_usable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No --version, and no rules either: not a very old iptables, a broken one."""
    from istio_agent.cni.netns import CommandError

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "iptables-legacy-save").write_text("#!/bin/sh\necho 'cannot initialize' >&2\nexit 1\n")
    (bin_dir / "iptables-legacy-save").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    with pytest.raises(CommandError, match=r"iptables-legacy-save.*failed.*cannot initialize"):
        probe("legacy")


def test_cni_mode_locks_the_current_namespace_not_the_node(pod: Netns) -> None:
    """--cni-mode without --network-namespace (Istio's UsePodScopedXtablesLock), with this machine's
    iptables-legacy (>= 1.8.6: XTABLES_LOCKFILE)."""
    backend = probe("legacy")
    assert backend.locks
    text = "*nat\n:ISTIO_INBOUND - [0:0]\nCOMMIT\n"
    scoped = Backend(backend.flavor, backend.version, pod_lock=True)
    with node_lock_held():
        in_namespace(pod.path, lambda: scoped.restore("v4", text, deadline=Deadline.after(HOLD_SECONDS)))
    assert istio_chains(pod)


def test_cni_mode_before_1_8_6_mounts_the_current_namespace(stubs_for: StubsFor, pod: Netns) -> None:
    stubs = stubs_for("1.8.5")
    scoped = Backend("legacy", probe("legacy").version, pod_lock=True)
    text = "*nat\n:ISTIO_INBOUND - [0:0]\nCOMMIT\n"
    with node_lock_held():
        in_namespace(pod.path, lambda: scoped.restore("v4", text, deadline=Deadline.after(HOLD_SECONDS)))
    assert istio_chains(pod)
    [restore] = stubs.restores()
    assert restore.lock_file == identity(pod.path)


def test_an_identical_rerun_on_1_8_4_does_not_wait_for_the_nodes_lock(
    stubs_for: StubsFor, pod: Netns
) -> None:
    """The re-run's state check restores the config into a throwaway namespace (Backend.canonical)."""
    stubs_for("1.8.4")
    backend = probe("legacy")
    apply_capture(ISTIO_INIT, netns=pod.path, backend=backend)
    with node_lock_held():
        outcome = apply_capture(
            ISTIO_INIT, netns=pod.path, backend=backend, deadline=Deadline.after(HOLD_SECONDS).at
        )
    assert outcome.action == "unchanged"
