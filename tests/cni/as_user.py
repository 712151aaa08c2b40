"""Run a program as another user (the proxy's uid 1337) the way a container of that user runs it.

A pod's image keeps its programs where every user may read them (``/usr/local``); a checkout need
not: as root, a clone under ``/root`` (0700) has its venv, its sources and maybe its interpreter
(pyenv) where uid 1337 cannot enter. So the command gets a mount namespace of its own in which each
directory on the way to what it needs that the user may not pass through is seen through an overlay
that opens it (``a+x``: passing through only; listings and files keep their modes), the upper
layers on a tmpfs: the host sees none of it, and the program runs as the user from its first
instruction, as in a container. Where nothing is closed, the command is ``setpriv`` alone.
``tests/e2e/pod.py`` opens an image's directories the same way.
"""

from __future__ import annotations

import atexit
import functools
import os
import shlex
import tempfile
from collections.abc import Iterable
from pathlib import Path

import pytest


def closed_directories(paths: Iterable[Path], uid: int, gid: int) -> list[str]:
    """Directories on the way to ``paths`` (as written and resolved) that ``uid``/``gid`` cannot
    pass through (no search permission), outermost first. Root passes through any."""
    closed: list[str] = []
    if uid == 0:
        return closed
    for path in paths:
        for way in (Path(os.path.abspath(path)), Path(os.path.realpath(path))):
            for directory in [*reversed(way.parents), way]:
                if str(directory) == "/" or not directory.is_dir():
                    continue
                status = directory.stat()
                bit = 0o100 if status.st_uid == uid else 0o010 if status.st_gid == gid else 0o001
                if not status.st_mode & bit:
                    closed.append(str(directory))
    return list(dict.fromkeys(closed))


def outermost(directories: Iterable[str]) -> list[str]:
    """The directories to overlay: one inside another is opened within the outer one's overlay."""
    unique = set(directories)
    return sorted(d for d in unique if not any(d.startswith(other + "/") for other in unique))


@functools.cache
def _mount_point() -> str:
    """An empty directory of this process where each command mounts its own tmpfs (removed at exit)."""
    point = tempfile.mkdtemp(prefix="ia-as-user-", dir="/tmp")
    atexit.register(os.rmdir, point)
    return point


def as_user(uid: int, needs: Iterable[Path], *, gid: int | None = None) -> list[str]:
    """The command-line prefix that runs a program as ``uid`` (group ``gid``, by default the same;
    no supplementary groups) with ``needs`` (its interpreter, scripts, packages) within reach.

    To be run as root: from inside a network namespace (``ip netns exec``) too. Skips the test when
    directories must be opened and the kernel has no overlayfs.
    """
    group = uid if gid is None else gid
    setpriv = ["setpriv", f"--reuid={uid}", f"--regid={group}", "--clear-groups"]
    closed = closed_directories(needs, uid, group)
    if not closed:
        return setpriv
    if "overlay" not in Path("/proc/filesystems").read_text():
        pytest.skip(
            f"running a program as uid {uid} from here needs overlayfs: {', '.join(closed)} closed to it"
        )
    for directory in closed:
        if "," in directory or ":" in directory:  # overlayfs option syntax
            raise ValueError(f"cannot open {directory!r} for uid {uid}: ',' or ':' in the path")
    view, q = _mount_point(), shlex.quote
    lines = ["set -eu", f"mount -t tmpfs -o mode=0700 as-user {q(view)}"]
    for index, directory in enumerate(outermost(closed)):
        upper, work = f"{view}/{index}/upper", f"{view}/{index}/work"
        layers = f"lowerdir={directory},upperdir={upper},workdir={work}"
        lines += [f"mkdir -p {q(upper)} {q(work)}", f"mount -t overlay overlay -o {q(layers)} {q(directory)}"]
    lines += [f"chmod a+x {q(directory)}" for directory in closed]
    lines.append('exec "$@"')
    return ["unshare", "--mount", "--", "sh", "-c", "\n".join(lines), "as-user", *setpriv]
