"""Linux inotify through the C library: one instance, watches added and removed one directory at a time.

The agent reads events on its event loop (the descriptor is non-blocking): no thread, no extra
package. Istio's agent (fsnotify) uses the same kernel interface.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from dataclasses import dataclass
from pathlib import Path

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
"""The kernel's queue overflowed: events were lost."""
IN_IGNORED = 0x00008000
"""The watch is gone (its directory was deleted, or it was removed)."""
IN_ONLYDIR = 0x01000000
DIRECTORY_CHANGES = (
    IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
    | IN_DELETE_SELF | IN_MOVE_SELF
)  # fmt: skip
"""A file in the directory, or the directory itself, was written, replaced, renamed or removed."""

_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then len bytes of name
_READ_SIZE = 64 * 1024


@dataclass(frozen=True)
class Event:
    wd: int
    mask: int
    name: str
    """The file's name within the watched directory; "" for an event on the directory itself."""


class Inotify:
    """One inotify instance; raises OSError (with the C library's errno) when a call fails."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)  # the C library the interpreter runs on
        fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            raise _os_error("inotify_init1")
        self._fd: int | None = fd

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError("inotify instance is closed")
        return self._fd

    def add_watch(self, directory: Path, mask: int = DIRECTORY_CHANGES) -> int:
        """Watch ``directory`` (following a symlink to it); the same directory twice gives the same wd."""
        wd = self._libc.inotify_add_watch(self.fileno(), os.fsencode(directory), mask | IN_ONLYDIR)
        if wd < 0:
            raise _os_error("inotify_add_watch", directory)
        return int(wd)

    def remove_watch(self, wd: int) -> None:
        """Stop a watch; one already gone (its directory was deleted) is not an error."""
        if self._libc.inotify_rm_watch(self.fileno(), wd) < 0:
            error = ctypes.get_errno()
            if error != errno.EINVAL:
                raise OSError(error, os.strerror(error))

    def read_events(self) -> list[Event]:
        """Every event queued now (an empty list when there is none)."""
        data = b""
        while True:
            try:
                chunk = os.read(self.fileno(), _READ_SIZE)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
        events = []
        offset = 0
        while offset + _EVENT.size <= len(data):
            wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
            offset += _EVENT.size
            name = data[offset : offset + length].split(b"\0", 1)[0]
            offset += length
            events.append(Event(wd, mask, os.fsdecode(name)))
        return events

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _os_error(call: str, path: Path | None = None) -> OSError:
    error = ctypes.get_errno()
    if path is None:
        return OSError(error, f"{call}: {os.strerror(error)}")
    return OSError(error, f"{call}: {os.strerror(error)}", str(path))
