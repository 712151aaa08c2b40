"""The one way the agent replaces a file: atomically, durably, with its final mode from the start.

Every file the agent writes is read by another process while it may be rewritten: Envoy reads its
bootstrap, applications read OUTPUT_CERTS, the next agent start reads the saved DNS name table, the
control plane's signing keys are shared with ``agentctl token``. Readers must see the old file or
the new one, never a partial one, and a crash or power loss must not leave an empty file behind.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_atomic(path: Path, data: bytes | bytearray | str, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data``; raises OSError (the temporary file is removed) when it cannot.

    The temporary file lives in the same directory (a rename across file systems is not atomic) under
    a random name (two writers never share one), gets ``mode`` before any data is written (a key is
    never readable by others, even briefly), and reaches the disk before the rename, which is made
    durable by syncing the directory.
    """
    payload = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.urandom(6).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)  # the umask may have narrowed the mode given to open()
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _sync_directory(path.parent)


def _sync_directory(directory: Path) -> None:
    """Make the rename durable; best effort (not every file system can sync a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
