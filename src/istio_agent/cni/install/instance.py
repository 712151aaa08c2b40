"""One install-cni per node: a lock in its run directory, taken before anything is installed.

Two instances would install the same files and, on exit, the second would take away what the first
still serves (every pod sandbox on the node would then fail). The second therefore stops at start,
having touched nothing. An ``flock`` is released by the kernel however its holder ends, so a killed
install-cni never leaves the node locked.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = "install-cni.lock"


class InstanceLock:
    """The node's install-cni lock in ``run_dir``; held from :meth:`acquire` until the process ends."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock; OSError saying so when another install-cni holds it (or the file cannot be made)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OSError(f"another install-cni is running on this node (it holds {self.path})") from None
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
