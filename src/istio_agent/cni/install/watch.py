"""Waiting until something install-cni depends on changes: a file in the CNI config directory, a binary, the token.

On :mod:`istio_agent.inotify`, read on the event loop. Not :class:`istio_agent.filewatch.FileWatcher`:
that one follows named files, and install-cni must also see *any* file appear in the config
directory (a new primary config that sorts first). As Istio does (``sleepWatchInstall``), a fresh
watcher is made for each wait after an install pass, so install-cni's own writes are never seen as
someone else's change.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

from istio_agent.inotify import IN_ATTRIB, IN_Q_OVERFLOW, Inotify
from istio_agent.log import scope

log = scope("cni-agent")


class DirWatcher:
    """Changes in some directories: all their files, or only the named ones. A context manager."""

    def __init__(self, interests: Iterable[tuple[Path, frozenset[str] | None]]) -> None:
        """``interests``: (directory, names of interest or None for every file). Missing directories are skipped."""
        self._inotify = Inotify()
        self._names: dict[int, frozenset[str] | None] = {}
        self._changed = asyncio.Event()
        try:
            for directory, names in interests:
                if not directory.is_dir():
                    log.debug("not watching %s: no such directory", directory)
                    continue
                wd = self._inotify.add_watch(directory)
                previous = self._names.get(wd, frozenset())
                self._names[wd] = None if names is None or previous is None else previous | names
        except BaseException:
            self._inotify.close()
            raise
        asyncio.get_running_loop().add_reader(self._inotify.fileno(), self._read)

    def _read(self) -> None:
        for event in self._inotify.read_events():
            if event.mask & IN_Q_OVERFLOW:
                self._changed.set()
                continue
            if event.mask & ~IN_ATTRIB == 0:
                continue  # a mode change alone is not a change of content (Istio ignores Chmod)
            names = self._names.get(event.wd, frozenset())
            if names is None or event.name in names or not event.name:
                log.debug("file changed: %s (mask %#x)", event.name or "<directory>", event.mask)
                self._changed.set()

    def pending(self) -> bool:
        """Whether a change has been seen already (events queued now are read first)."""
        self._read()
        return self._changed.is_set()

    async def wait(self, timeout: float | None = None) -> bool:
        """Until a change (True) or ``timeout`` seconds (False)."""
        try:
            async with asyncio.timeout(timeout):
                await self._changed.wait()
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        try:
            asyncio.get_running_loop().remove_reader(self._inotify.fileno())
        finally:
            self._inotify.close()

    def __enter__(self) -> DirWatcher:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
