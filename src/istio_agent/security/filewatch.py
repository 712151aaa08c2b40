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

There is a single OS watch (one inotify instance) for all directories, which matters because
inotify instances are limited per user and every sidecar on a node runs as the same user. When
the set of directories changes, the new watch is opened *before* the old one is retired, and what
the old one has buffered is taken over synchronously, so no event is lost in the hand-over (an
event landing in the microseconds between the two may be seen twice: a rare extra call, never a
missed one). The low-level ``watchfiles`` notifier is used instead of ``awatch`` because it opens
synchronously and can be handed over like this: once ``watch()`` (or ``start()``) returns, changes
are being recorded.

A directory that cannot be watched (permissions, OS watch limits) is counted in
``num_file_watcher_failures``, left out, and retried in the background with backoff; the other
directories are watched meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

from watchfiles._rust_notify import RustNotify

from istio_agent.log import scope
from istio_agent.metrics import counter

log = scope("cache")

FILE_WATCHER_FAILURES = counter(
    "num_file_watcher_failures", "Number of times the file watcher failed to add a watch on a directory"
)

_STEP_MS = 50
_HANDOVER_WAIT_MS = 10
_RETIRE_GRACE = 3 * _STEP_MS / 1000
"""How long a retired notifier's running watch call may go on to return events it already read."""
"""How long a re-opened watch waits for the old one's in-flight events (the notifier thread hands
them over asynchronously; 1 ms lost changes on a busy machine). Paid only when the watched set of
directories changes."""
"""How long the notifier waits for more events before handing a batch over."""
_MAX_BATCH_MS = 500
"""Upper bound on how long the notifier groups a continuous stream of events."""
_MAX_BACKLOG_ROUNDS = 100
"""Hand-overs in a row before giving up on precision and calling back every resource."""
_MAX_BURST_FACTOR = 10
"""A burst is cut after ``debounce * _MAX_BURST_FACTOR`` so a file written non-stop still reports."""
_RETRY_INITIAL = 0.1
_RETRY_MAX = 30.0
_MAX_LINK_HOPS = 40


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


def _can_watch(directory: Path) -> bool:
    try:
        RustNotify([str(directory)], False, False, 300, False, False).close()
    except Exception as exc:
        log.debug("watching %s failed: %s", directory, exc)
        return False
    return True


def _nearest_existing(directory: Path) -> tuple[Path, Path]:
    """The nearest existing ancestor of a missing ``directory`` and its child on the way down."""
    top, current = directory, directory.parent
    while not _is_dir(current) and current != current.parent:
        top, current = current, current.parent
    return current, top


class _Notifier:
    """One OS-level watch over a set of directories (a watchfiles RustNotify)."""

    def __init__(self, directories: frozenset[Path]) -> None:
        self.directories = directories
        self.rust = RustNotify([str(d) for d in sorted(directories)], False, False, 300, False, False)
        self.stop = threading.Event()
        self._closed = False

    def take_buffered(self) -> set[Path] | None:
        """Synchronously take the changes buffered so far (costs at most ~10 ms); None if unknown."""
        try:
            result = self.rust.watch(0, 0, _HANDOVER_WAIT_MS, None)
        except Exception:
            return None
        if isinstance(result, set):
            return {Path(path) for _, path in result}
        return set() if result == "timeout" else None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.rust.close()


class FileWatcher:
    """Calls ``on_change(resource)`` once per burst of changes to any file of a watched resource."""

    def __init__(
        self, on_change: Callable[[str], None], *, debounce: timedelta = timedelta(milliseconds=100)
    ) -> None:
        if debounce < timedelta(0):
            raise ValueError(f"file watcher debounce must not be negative, got {debounce}")
        self._on_change = on_change
        self._debounce = debounce.total_seconds()
        self._paths: dict[str, set[Path]] = {}
        # resource -> paths (with resolved parents) whose events concern it: now, before the last
        # refresh, and when the changes taken over from a retired notifier happened.
        self._interest: dict[str, set[Path]] = {}
        self._previous_interest: dict[str, set[Path]] = {}
        self._backlog_interest: dict[str, set[Path]] = {}
        self._wanted: frozenset[Path] = frozenset()
        self._missing_logged: set[Path] = set()
        self._failed_logged: set[Path] = set()
        self._notifier: _Notifier | None = None
        self._in_flight: _Notifier | None = None
        self._backlog: set[Path] = set()
        self._backlog_unknown = False
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._burst_start: dict[str, float] = {}
        self._retry: asyncio.TimerHandle | None = None
        self._retry_delay = _RETRY_INITIAL
        self._wake: asyncio.Event | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None

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
            self._process_backlog()

    def unwatch(self, resource: str) -> None:
        """Stop watching ``resource``; a pending call for it is dropped."""
        if self._paths.pop(resource, None) is None:
            return
        self._cancel_timer(resource)
        self._refresh()
        self._process_backlog()

    def watched_paths(self, resource: str) -> set[Path]:
        """The absolute paths watched for ``resource`` (as given, symlinks not resolved)."""
        return set(self._paths.get(resource, ()))

    async def start(self) -> None:
        """Open the watch; changes made after this returns are reported."""
        if self._task is not None:
            return
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="istio-file-watch")
        self._wanted = frozenset()
        self._retry_delay = _RETRY_INITIAL
        self._task = asyncio.get_running_loop().create_task(self._run(), name="file-watcher")
        self._refresh()
        self._backlog.clear()  # nothing was being watched before start
        self._backlog_unknown = False

    async def stop(self) -> None:
        """Stop watching and drop pending calls; nothing is left running."""
        task, self._task = self._task, None
        if task is None:
            return
        for resource in list(self._timers):
            self._cancel_timer(resource)
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._notifier is not None:
            self._notifier.stop.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if self._notifier is not None:
            self._notifier.close()
            self._notifier = None
        self._backlog.clear()
        self._backlog_interest = {}
        self._backlog_unknown = False
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # -- what to watch ------------------------------------------------------------------------

    @property
    def _running(self) -> bool:
        return self._task is not None

    def _refresh(self, *, force: bool = False) -> None:
        """Trace every watched path again and, when running, make the OS watch cover its directories."""
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
        self._previous_interest, self._interest = self._interest, interest
        for directory in missing - self._missing_logged:
            log.warning("directory %s of a watched file is missing; watching for it to come back", directory)
        self._missing_logged = missing
        if self._running and (force or frozenset(directories) != self._wanted):
            self._wanted = frozenset(directories)
            self._rebuild(force=force)

    def _rebuild(self, *, force: bool = False) -> None:
        """Watch the wanted directories (leaving out ones that fail) and retire the old notifier."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        current = self._notifier
        notifier: _Notifier | None = None
        failed: set[Path] = set()
        if self._wanted:
            try:
                notifier = _Notifier(self._wanted)
            except Exception:
                failed = {d for d in self._wanted if not _can_watch(d)}
                usable = self._wanted - failed
                if current is not None and current.directories == usable and not force:
                    notifier = current  # nothing would change: keep it, no hand-over
                elif usable:
                    try:
                        notifier = _Notifier(usable)
                    except Exception:
                        failed = set(self._wanted)
        if notifier is not current:
            self._replace(notifier)
        if failed:
            FILE_WATCHER_FAILURES.inc(len(failed))
            for directory in failed - self._failed_logged:
                log.warning("failed to watch directory %s; retrying in the background", directory)
            self._schedule_retry()
        self._failed_logged = failed

    def _replace(self, notifier: _Notifier | None) -> None:
        """Install ``notifier`` and take over what the old one buffered before letting it go."""
        old, self._notifier = self._notifier, notifier
        if old is not None:
            taken = old.take_buffered()
            for resource, keys in self._previous_interest.items():
                self._backlog_interest.setdefault(resource, set()).update(keys)
            if taken is None:
                self._backlog_unknown = True
            else:
                self._backlog |= taken
            if old is self._in_flight:
                # Its watch call may already hold events it read: stopping it now would drop
                # them. Let the call return its batch (it does within one step of the last
                # event); stop it only if it is still idle after that. The loop closes it.
                asyncio.get_running_loop().call_later(_RETIRE_GRACE, old.stop.set)
            else:
                old.stop.set()
                old.close()
        if self._wake is not None:
            self._wake.set()

    def _schedule_retry(self) -> None:
        self._retry = asyncio.get_running_loop().call_later(self._retry_delay, self._retry_rebuild)
        self._retry_delay = min(self._retry_delay * 2, _RETRY_MAX)

    def _retry_rebuild(self) -> None:
        self._retry = None
        if not self._running:
            return
        wanted = self._wanted
        self._refresh()  # rebuilds by itself when the directories changed meanwhile
        if self._wanted == wanted:
            self._rebuild()
        self._process_backlog()

    # -- the watch loop -----------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            notifier = self._notifier
            if notifier is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                result = await self._watch_once(notifier)
            finally:
                if notifier is not self._notifier:
                    notifier.close()  # retired while its watch call ran
            self._process(result, notifier)

    async def _watch_once(self, notifier: _Notifier) -> object:
        """One ``RustNotify.watch`` in the watcher thread; on cancellation, wait for it to return."""
        assert self._executor is not None
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(
            self._executor, notifier.rust.watch, _MAX_BATCH_MS, _STEP_MS, 0, notifier.stop
        )
        self._in_flight = notifier
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # The thread notices the stop flag within one step; never leave it running.
            notifier.stop.set()
            await asyncio.wait([future])
            raise
        except Exception as exc:
            return exc
        finally:
            self._in_flight = None

    def _process(self, result: object, notifier: _Notifier) -> None:
        if isinstance(result, set):
            if not self._failed_logged:
                self._retry_delay = _RETRY_INITIAL  # events flow again: next failure retries quickly
            self._backlog |= {Path(path) for _, path in result}
        elif isinstance(result, Exception) and notifier is self._notifier:
            FILE_WATCHER_FAILURES.inc()
            log.warning("file watcher failed (%s); re-opening it and re-reading all watched files", result)
            self._wanted = frozenset()
            self._replace(None)
            self._backlog_unknown = True
            self._schedule_retry()
        # "stop" (retired or stopping) and "signal" (never in a worker thread) need nothing.
        self._process_backlog()

    def _process_backlog(self) -> None:
        """Turn buffered changes into scheduled calls; refreshing may hand over and buffer more."""
        for _ in range(_MAX_BACKLOG_ROUNDS):
            if not self._backlog and not self._backlog_unknown:
                self._backlog_interest = {}
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
        before = {r: self._interest.get(r, set()) | self._backlog_interest.get(r, set()) for r in self._paths}
        self._backlog_interest = {}
        # An event on a watched directory itself means it was removed or moved: the OS watch may
        # now point at a dead inode even if a new directory already took its place, so re-open.
        replaced_dirs = changed & self._wanted
        self._refresh(force=bool(replaced_dirs))
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
