"""Watch file-mounted certificates and keys, and say which secret resource changed.

A resource (``default``, ``ROOTCA``, ``file-cert:...``) is watched by *all* of its files: unlike
Istio, which only watches the certificate, a key-only replacement also triggers the callback.

Why it works the way it does:

- Directories are watched, never file inodes, so a file replaced by ``rename`` (atomic write) or
  deleted and recreated keeps being watched. Only events on the files we care about count;
  other files in the same directory are ignored.
- Symlinks are followed by hand, so every link on the way (e.g. Kubernetes' ``cert.pem ->
  ..data/cert.pem`` and ``..data -> ..2026_01_01``) and the final target are known. Events on any
  of them count, and the chain is traced again after every batch of events because kubelet swaps
  ``..data`` on each secret update. Links directly under ``/`` (``/var``, ``/tmp`` on some
  systems) are followed but not watched, like Istio.
- When a directory disappears, its nearest existing ancestor is watched until it comes back, and
  its re-creation counts as a change of the resources below it.
- Events are debounced per resource: a burst of events within ``debounce`` of each other gives one
  call, so an atomic replace or a Kubernetes secret rotation gives exactly one call.

There is a single inotify instance for all directories (:mod:`istio_agent.inotify`), because
inotify instances are limited per user and every sidecar on a node runs as the same user. Watches
are added and removed one directory at a time on that instance, so changing what is watched never
drops an event, and its events are read on the event loop: no thread. Once ``watch()`` (or
``start()``) returns, changes are being recorded. If the kernel's event queue overflows, every
resource is reported changed.

A directory that cannot be watched (permissions, inotify limits) is counted in
``num_file_watcher_failures``, left out, and retried in the background with backoff; the other
directories are watched meanwhile.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

from istio_agent.inotify import IN_DELETE_SELF, IN_IGNORED, IN_MOVE_SELF, IN_Q_OVERFLOW, Inotify
from istio_agent.log import scope
from istio_agent.metrics import Registry

log = scope("cache")


_MAX_BACKLOG_ROUNDS = 100
"""Rounds of re-tracing in a row before giving up on precision and calling back every resource."""
_MAX_BURST_FACTOR = 10
"""A burst is cut after ``debounce * _MAX_BURST_FACTOR`` so a file written non-stop still reports."""
_RETRY_INITIAL = 0.1
_RETRY_MAX = 30.0
_MAX_LINK_HOPS = 40
_GONE = IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF
"""The watched directory itself was removed or moved: its watch no longer covers the path."""


class _WatcherMetrics:
    """The file watcher's metrics (Istio's names)."""

    def __init__(self, registry: Registry) -> None:
        self.failures = registry.counter(
            "num_file_watcher_failures",
            "Number of times the file watcher failed to add a watch on a directory",
        )


def _is_symlink(path: Path) -> bool:
    try:
        return path.is_symlink()
    except OSError:  # e.g. an unreadable directory on the way: treat as a plain path
        return False


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def _absolute(path: Path | str) -> Path:
    """The absolute, lexically cleaned form of ``path`` (symlinks kept), like Go's filepath.Abs."""
    return Path(os.path.abspath(path))


def trace_links(path: Path) -> tuple[Path, set[Path]]:
    """Follow ``path`` component by component: its final target and every symlink passed on the way.

    All returned paths have fully resolved parent directories, which is the form the notifier
    reports events in. Missing components are taken literally (a broken link yields its target).
    """
    links: set[Path] = set()
    current = Path(path.anchor or "/")
    pending = list(path.parts[1:])
    hops = 0
    while pending:
        name = pending.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            current = current.parent
            continue
        candidate = current / name
        if hops < _MAX_LINK_HOPS and _is_symlink(candidate):
            try:
                target = os.readlink(candidate)
            except OSError:
                current = candidate
                continue
            hops += 1
            if current != current.parent:
                links.add(candidate)
            target_path = Path(target)
            if target_path.is_absolute():
                current = Path(target_path.anchor)
                pending = list(target_path.parts[1:]) + pending
            else:
                pending = list(target_path.parts) + pending
        else:
            current = candidate
    return current, links


def _interesting_paths(path: Path) -> set[Path]:
    """Paths (with resolved parents) whose create/modify/delete means ``path`` may have changed."""
    final, links = trace_links(path)
    paths = links | {final}
    own = Path(os.path.realpath(path.parent)) / path.name
    if own in links:
        # kubelet publishes a new secret version by creating <dir>/..data (AtomicWriter).
        paths.add(own.parent / "..data")
    return paths


def _nearest_existing(directory: Path) -> tuple[Path, Path]:
    """The nearest existing ancestor of a missing ``directory`` and its child on the way down."""
    top, current = directory, directory.parent
    while not _is_dir(current) and current != current.parent:
        top, current = current, current.parent
    return current, top


class FileWatcher:
    """Calls ``on_change(resource)`` once per burst of changes to any file of a watched resource."""

    def __init__(
        self,
        on_change: Callable[[str], None],
        *,
        debounce: timedelta = timedelta(milliseconds=100),
        registry: Registry,
    ) -> None:
        if debounce < timedelta(0):
            raise ValueError(f"file watcher debounce must not be negative, got {debounce}")
        self._on_change = on_change
        self._debounce = debounce.total_seconds()
        self._metrics = _WatcherMetrics(registry)
        self._paths: dict[str, set[Path]] = {}
        self._interest: dict[str, set[Path]] = {}
        """resource -> paths (with resolved parents) whose events concern it."""
        self._wanted: frozenset[Path] = frozenset()
        self._watches: dict[Path, int] = {}
        """Watched directory -> its inotify watch descriptor."""
        self._directories: dict[int, set[Path]] = {}
        """Watch descriptor -> the wanted directories it covers (two paths may be one inode: bind mounts)."""
        self._missing_logged: set[Path] = set()
        self._failed_logged: set[Path] = set()
        self._running = False
        self._open_failure_logged = False
        self._inotify: Inotify | None = None
        """Opened when the first directory is wanted: an agent with nothing to watch holds none."""
        self._backlog: set[Path] = set()
        self._backlog_unknown = False
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._burst_start: dict[str, float] = {}
        self._retry: asyncio.TimerHandle | None = None
        self._retry_delay = _RETRY_INITIAL

    # -- public API ---------------------------------------------------------------------------

    def watch(self, resource: str, paths: Sequence[Path]) -> None:
        """Watch ``paths`` (made absolute) for ``resource``; watching a pair again is a no-op.

        Call from the event loop, before or after ``start()``. A directory that cannot be watched
        is retried in the background (and counted in ``num_file_watcher_failures``).
        """
        wanted = self._paths.setdefault(resource, set())
        before = len(wanted)
        wanted.update(_absolute(p) for p in paths)
        if len(wanted) != before or resource not in self._interest:
            self._refresh()

    def unwatch(self, resource: str) -> None:
        """Stop watching ``resource``; a pending call for it is dropped."""
        if self._paths.pop(resource, None) is None:
            return
        self._cancel_timer(resource)
        self._refresh()

    def watched_paths(self, resource: str) -> set[Path]:
        """The absolute paths watched for ``resource`` (as given, symlinks not resolved)."""
        return set(self._paths.get(resource, ()))

    async def start(self) -> None:
        """Start watching; changes made after this returns are reported.

        Never fails: an inotify instance or a watch that cannot be had now (the per-user limits are
        shared by every sidecar of a node) is counted, logged and retried in the background.
        """
        if self._running:
            return
        self._running = True
        self._retry_delay = _RETRY_INITIAL
        self._refresh()

    async def stop(self) -> None:
        """Stop watching and drop pending calls; nothing is left running."""
        if not self._running:
            return
        self._running = False
        for resource in list(self._timers):
            self._cancel_timer(resource)
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        inotify, self._inotify = self._inotify, None
        if inotify is not None:
            asyncio.get_running_loop().remove_reader(inotify.fileno())
            inotify.close()
        self._watches.clear()
        self._directories.clear()
        self._wanted = frozenset()
        self._backlog.clear()
        self._backlog_unknown = False

    # -- what to watch ------------------------------------------------------------------------

    def _refresh(self) -> None:
        """Trace every watched path again and, when running, make the watches cover its directories."""
        interest: dict[str, set[Path]] = {}
        directories: set[Path] = set()
        missing: set[Path] = set()
        for resource, paths in self._paths.items():
            keys: set[Path] = set()
            for path in paths:
                keys |= _interesting_paths(path)
            for key in list(keys):
                directory = key.parent
                if _is_dir(directory):
                    directories.add(directory)
                    continue
                ancestor, top = _nearest_existing(directory)
                directories.add(ancestor)
                keys.add(top)
                missing.add(directory)
            interest[resource] = keys
        self._interest = interest
        for directory in missing - self._missing_logged:
            log.warning("directory %s of a watched file is missing; watching for it to come back", directory)
        self._missing_logged = missing
        self._wanted = frozenset(directories)
        if self._running:
            self._sync_watches()

    def _open(self) -> Inotify | None:
        """The inotify instance, opened now if need be; None (counted, logged once) when it cannot be."""
        if self._inotify is None:
            try:
                inotify = Inotify()
            except OSError as err:
                self._metrics.failures.inc()
                if not self._open_failure_logged:
                    self._open_failure_logged = True
                    log.warning("cannot watch files (%s); retrying in the background", err.strerror)
                return None
            asyncio.get_running_loop().add_reader(inotify.fileno(), self._read_events)
            self._inotify = inotify
            self._open_failure_logged = False
        return self._inotify

    def _sync_watches(self) -> None:
        """Watch exactly the wanted directories: add the new ones, remove the others, retry failures."""
        for directory in [d for d in self._watches if d not in self._wanted]:
            self._unwatch(directory)
        missing = sorted(self._wanted - self._watches.keys())
        failed: set[Path] = set()
        inotify = self._open() if missing else self._inotify
        if inotify is None:
            failed.update(missing)  # no instance: counted once in _open, every directory retried
        else:
            for directory in missing:
                try:
                    wd = inotify.add_watch(directory)
                except OSError as err:
                    failed.add(directory)
                    self._metrics.failures.inc()
                    log.debug("watching %s failed: %s", directory, err.strerror)
                    continue
                self._watches[directory] = wd
                self._directories.setdefault(wd, set()).add(directory)
        if failed:
            for directory in failed - self._failed_logged:
                log.warning("failed to watch directory %s; retrying in the background", directory)
            if self._retry is None:
                self._retry = asyncio.get_running_loop().call_later(self._retry_delay, self._retry_watches)
                self._retry_delay = min(self._retry_delay * 2, _RETRY_MAX)
        else:
            self._retry_delay = _RETRY_INITIAL
        self._failed_logged = failed

    def _unwatch(self, directory: Path) -> None:
        """Stop watching a directory no longer wanted (its watch goes when no other path shares it)."""
        wd = self._watches.pop(directory)
        sharing = self._directories.get(wd, set())
        sharing.discard(directory)
        if not sharing:
            self._forget(wd, remove=True)

    def _forget(self, wd: int, *, remove: bool) -> None:
        """Drop a watch and every directory it covered; ``remove`` it from the kernel if still there."""
        for directory in self._directories.pop(wd, set()):
            if self._watches.get(directory) == wd:
                del self._watches[directory]
        if remove and self._inotify is not None:
            try:
                self._inotify.remove_watch(wd)
            except OSError as err:
                log.debug("removing watch %d failed: %s", wd, err.strerror)

    def _retry_watches(self) -> None:
        self._retry = None
        if self._running:
            self._refresh()

    # -- events -----------------------------------------------------------------------------------

    def _read_events(self) -> None:
        """The inotify descriptor is readable: turn its events into changed paths."""
        if self._inotify is None:
            return
        try:
            events = self._inotify.read_events()
        except OSError as err:
            self._metrics.failures.inc()
            log.warning("reading file change events failed (%s); re-reading all watched files", err.strerror)
            self._backlog_unknown = True
            events = []
        for event in events:
            if event.mask & IN_Q_OVERFLOW:
                log.warning("the kernel dropped file change events; re-reading all watched files")
                self._backlog_unknown = True
                continue
            directories = self._directories.get(event.wd)
            if not directories:
                continue  # a watch removed a moment ago
            for directory in directories:
                self._backlog.add(directory / event.name if event.name else directory)
            if not event.name and event.mask & _GONE:
                # Removed or moved away: re-tracing watches the path again (its new inode, or the
                # nearest ancestor until it comes back).
                self._forget(event.wd, remove=not event.mask & IN_IGNORED)
        self._process_backlog()

    def _process_backlog(self) -> None:
        """Turn recorded changes into scheduled calls."""
        for _ in range(_MAX_BACKLOG_ROUNDS):
            if not self._backlog and not self._backlog_unknown:
                return
            changed, self._backlog = self._backlog, set()
            if self._backlog_unknown:
                self._backlog_unknown = False
                changed = set()
                for resource in self._paths:
                    self._schedule(resource)
            self._handle_changes(changed)
        # The file system keeps moving under us: play safe, everything may have changed.
        self._backlog.clear()
        for resource in self._paths:
            self._schedule(resource)

    def _handle_changes(self, changed: set[Path]) -> None:
        before = {r: set(self._interest.get(r, ())) for r in self._paths}
        # An event on a watched directory itself means it was removed or moved (or re-created in
        # place): everything below it may have changed.
        replaced_dirs = {path for path in changed if path in self._wanted}
        self._refresh()
        for resource, keys in self._interest.items():
            relevant = keys | before.get(resource, set())
            if not changed.isdisjoint(relevant) or any(key.parent in replaced_dirs for key in relevant):
                self._schedule(resource)

    # -- debouncing and calling back ----------------------------------------------------------

    def _schedule(self, resource: str) -> None:
        """(Re)arm the resource's timer: the call happens once events stop for ``debounce``."""
        if not self._running:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        first = self._burst_start.setdefault(resource, now)
        handle = self._timers.pop(resource, None)
        if handle is not None:
            handle.cancel()
        deadline = first + self._debounce * _MAX_BURST_FACTOR
        delay = max(0.0, min(self._debounce, deadline - now))
        self._timers[resource] = loop.call_later(delay, self._fire, resource)

    def _cancel_timer(self, resource: str) -> None:
        handle = self._timers.pop(resource, None)
        if handle is not None:
            handle.cancel()
        self._burst_start.pop(resource, None)

    def _fire(self, resource: str) -> None:
        self._timers.pop(resource, None)
        self._burst_start.pop(resource, None)
        if resource not in self._paths or not self._running:
            return
        try:
            self._on_change(resource)
        except Exception:
            log.exception("file change callback for %s failed", resource)
