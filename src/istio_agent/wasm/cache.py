"""The Wasm module cache on the ``istio-data`` volume: each module fetched once, kept until unused.

As Istio's ``pkg/wasm/cache.go``: a module lives at ``<cache_dir>/<sha256 of its name>/<checksum>.wasm``
(the name is the URL, or for ``oci://`` the repository, so every tag of an image shares a directory),
and is found by its checksum: the one the plugin gives, the digest of an ``oci://…@sha256:`` URL, or
the one last fetched from the URL. That last one is used as the pull policy says: ``IfNotPresent``
always, ``Always`` only while the plugin's resource version is unchanged, and unspecified as
``IfNotPresent`` except for an image tagged ``latest``. For an image the manifest's digest is the
checksum, so when it is already cached the module itself is not downloaded. Modules unused for
``WASM_MODULE_EXPIRY`` are removed every ``WASM_PURGE_INTERVAL``.

Where we differ from Istio, on purpose:

- The cache survives a restart. Istio keeps its maps in memory only, so a restarted agent fetches
  every module again (its files are on disk, unused). Here the maps are rebuilt at start: modules
  from the directory (the last use is the file's mtime, touched on every hit), and each URL's last
  checksum and resource versions from ``urls.json`` in the same directory. So after a restart a
  lookup hits exactly when it would have without one. Without that index (lost, unreadable) a lookup
  by checksum or digest still hits; by URL alone it fetches again (for an image, only the manifest).
- Concurrent requests for one module share one fetch; a caller that gives up does not cancel it.
- A resource version is recorded only once its lookup or fetch succeeded (Istio records it before
  fetching, so after a failed ``Always`` pull the same version is served the old module).
- An untagged image is ``latest`` for the default policy (Istio looks for a literal ``:latest``).
- A fetch is checked only against the checksum asked for (the plugin's or the URL's digest), never
  against the URL's previous one; checksums compare case-insensitively. An image index's digest
  (a multi-platform image pinned as ``crane digest`` shows it) is accepted for the image the index
  lists, and the module is kept under it (Istio compares it with the chosen image's digest only,
  a mismatch).
- A module file removed behind the cache's back is fetched again rather than handed to Envoy.
- Files are written atomically (never seen half-written) and one ``wasm_cache_lookup_count`` is
  counted per request (Istio counts a second lookup after a download without a checksum).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from istio_agent.config.wasm import DEFAULT_MODULE_EXPIRY, DEFAULT_PURGE_INTERVAL, WasmSettings
from istio_agent.files import write_atomic
from istio_agent.http.client import HTTPError
from istio_agent.http.exchange import describe
from istio_agent.log import scope
from istio_agent.wasm import metrics
from istio_agent.wasm.errors import FetchError
from istio_agent.wasm.httpfetch import HttpFetcher, is_wasm_binary
from istio_agent.wasm.metrics import WasmMetrics
from istio_agent.wasm.options import GetOptions, PullPolicy
from istio_agent.wasm.ssrf import DialGuard

__all__ = ["GetOptions", "ImageFetcherFactory", "ModuleCache", "PullPolicy", "module_name"]

log = scope("wasm")

OCI_PREFIX = "oci://"
SCHEMES = frozenset({"http", "https", "oci"})
INDEX_NAME = "urls.json"
INDEX_VERSION = 1
_HEX64 = re.compile(r"[0-9a-f]{64}")
_URL_DIGEST = re.compile(r"@sha256:([0-9a-fA-F]{64})$")

ModuleKey = tuple[str, str]
"""(sha256 hex of the module name, checksum): the module's directory and file name."""


class PreparedModule(Protocol):
    """An image whose manifest is in (``istio_agent.wasm.oci.PreparedImage``)."""

    digest: str
    index_digest: str | None
    """The image index the reference named, if it named one (``digest`` is then the chosen image's)."""

    async def fetch(self) -> bytes | bytearray: ...


class ImagePreparer(Protocol):
    async def prepare(self, reference: str) -> PreparedModule: ...


class ImageFetcherFactory(Protocol):
    """Makes an image fetcher for one fetch (``istio_agent.wasm.oci.ImageFetcher`` by default)."""

    def __call__(
        self, *, guard: DialGuard, max_bytes: int, insecure: bool, pull_secret: bytes | None
    ) -> ImagePreparer: ...


def _oci_image_fetcher(
    *, guard: DialGuard, max_bytes: int, insecure: bool, pull_secret: bytes | None
) -> ImagePreparer:
    from istio_agent.wasm.oci import ImageFetcher  # only agents with oci:// plugins need it

    return ImageFetcher(guard=guard, max_bytes=max_bytes, insecure=insecure, pull_secret=pull_secret)


@dataclass
class _Module:
    path: Path
    last: float
    """When it was last asked for (wall clock: it is the file's mtime across restarts)."""


@dataclass
class _UrlRecord:
    """What a URL gave last time: its module, and the resource version each plugin last saw."""

    module: str
    checksum: str
    versions: dict[str, str] = field(default_factory=dict)


class ModuleCache:
    """One per agent: ``get`` a module's local path; ``start``/``stop`` the periodic purge."""

    def __init__(
        self,
        settings: WasmSettings,
        metrics: WasmMetrics,
        *,
        guard: DialGuard | None = None,
        http_fetcher: HttpFetcher | None = None,
        image_fetcher: ImageFetcherFactory | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._dir = settings.cache_dir
        self._guard = guard or DialGuard(settings.blocked_networks)
        self._http = http_fetcher or HttpFetcher(settings, self._guard)
        self._image_fetcher = image_fetcher or _oci_image_fetcher
        self._clock = clock
        self._modules: dict[ModuleKey, _Module] = {}
        self._urls: dict[str, _UrlRecord] = {}
        self._flights: dict[tuple[str, str, bytes | None], asyncio.Task[tuple[str, Path]]] = {}
        self._index_lock = asyncio.Lock()
        self._purger: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Take in what an earlier run left on disk, and start purging."""
        await asyncio.to_thread(self._load)
        self._metrics.cache_entries.set(len(self._modules))
        self._purger = asyncio.create_task(self._purge_loop(), name="wasm-cache-purge")

    async def stop(self) -> None:
        """Stop purging and cancel fetches in flight (the modules stay on disk for the next start)."""
        tasks = [t for t in (self._purger, *self._flights.values()) if t is not None]
        self._purger = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def get(self, url: str, options: GetOptions) -> Path:
        """The local path of the module at ``url``, fetched unless cached; ``FetchError`` if it cannot be had."""
        scheme = url.partition("://")[0].lower() if "://" in url else ""
        if scheme not in SCHEMES:
            raise FetchError(f"unsupported Wasm module downloading URL scheme: {scheme}")
        name = _hash(module_name(url))
        expected = options.checksum.lower()
        if not expected and scheme == "oci":
            digest = _URL_DIGEST.search(url)
            expected = digest.group(1).lower() if digest else ""
        checksum = expected or self._last_checksum(url, options)
        module = self._cached((name, checksum)) if checksum else None
        self._metrics.cache_lookups.labels(hit="true" if module else "false").inc()
        if module is not None:
            self._touch(module)
        else:
            checksum, path = await self._once(
                (url, expected, options.pull_secret),
                lambda: self._fetch(url, scheme, name, expected, options),
            )
            module = self._modules.get((name, checksum)) or _Module(path, self._clock())
        if self._remember(url, name, checksum, options):
            await self._save_index()
        return module.path

    # --- lookups ---

    def _last_checksum(self, url: str, options: GetOptions) -> str:
        """The checksum ``url`` gave last, if the pull policy lets it stand for this request."""
        record = self._urls.get(url)
        if record is None:
            return ""
        if ignores_resource_version(options.pull_policy, url):
            return record.checksum
        seen = record.versions.get(options.resource_name)
        return record.checksum if seen == options.resource_version else ""

    def _cached(self, key: ModuleKey) -> _Module | None:
        module = self._modules.get(key)
        if module is not None and not module.path.is_file():
            log.warning("Wasm module %s was removed from the cache directory; fetching it again", module.path)
            self._forget(key)
            module = None
        return module

    def _touch(self, module: _Module) -> None:
        module.last = self._clock()
        with contextlib.suppress(OSError):  # the last use survives a restart; best effort
            os.utime(module.path, (module.last, module.last))

    def _remember(self, url: str, name: str, checksum: str, options: GetOptions) -> bool:
        """Record what ``url`` gave for this resource; whether that changed anything.

        A URL pinned to a digest needs no record (its checksum is in it), as in Istio.
        """
        if url.startswith(OCI_PREFIX) and "@" in url:
            return False
        record = self._urls.get(url)
        if record is None or (record.module, record.checksum) != (name, checksum):
            versions = record.versions if record is not None else {}
            record = self._urls[url] = _UrlRecord(name, checksum, versions)
            record.versions[options.resource_name] = options.resource_version
            return True
        if record.versions.get(options.resource_name) == options.resource_version:
            return False
        record.versions[options.resource_name] = options.resource_version
        return True

    # --- fetching ---

    async def _once(
        self, key: tuple[str, str, bytes | None], fetch: Callable[[], Coroutine[Any, Any, tuple[str, Path]]]
    ) -> tuple[str, Path]:
        """Run ``fetch`` once for every concurrent request of ``key``; a waiter that is cancelled
        leaves it running for the others."""
        task = self._flights.get(key)
        if task is None:
            task = asyncio.create_task(fetch(), name=f"wasm-fetch {key[0]}")
            self._flights[key] = task
            task.add_done_callback(lambda done: self._landed(key, done))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or not current.cancelling()):
                raise FetchError(f"fetching {key[0]} was cancelled: the module cache stopped") from None
            raise

    def _landed(self, key: tuple[str, str, bytes | None], task: asyncio.Task[tuple[str, Path]]) -> None:
        if self._flights.get(key) is task:
            del self._flights[key]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have gone

    async def _fetch(
        self, url: str, scheme: str, name: str, expected: str, options: GetOptions
    ) -> tuple[str, Path]:
        """Download, check and store the module; its checksum and path."""
        prepared: PreparedModule | None = None
        deadline = asyncio.get_running_loop().time() + options.timeout
        if scheme == "oci":
            prepared = await self._prepare(url, options, deadline)
            checksum = prepared.digest.lower()
            if expected and expected == (prepared.index_digest or "").lower():
                checksum = expected  # the index pinned lists this image: kept under the pin, found by it
            body = b""
        else:
            body = await self._counted(self._http.fetch(url, timeout=options.timeout))
            checksum = hashlib.sha256(body).hexdigest()
        if not expected:
            known = self._cached((name, checksum))
            if known is not None:  # e.g. another tag of an image already here: no blob download
                self._touch(known)
                return checksum, known.path
        elif checksum != expected:
            self._count(metrics.CHECKSUM_MISMATCH)
            raise FetchError(
                f"module downloaded from {url} has checksum {checksum}, which does not match: {expected}",
                metrics.CHECKSUM_MISMATCH,
            )
        if prepared is not None:
            body = await self._counted(_bounded(prepared.fetch(), deadline, url, metrics.DOWNLOAD_FAILURE))
        if not is_wasm_binary(body):
            self._count(metrics.FETCH_FAILURE)
            raise FetchError(f"fetched Wasm binary from {url} is invalid", metrics.FETCH_FAILURE)
        self._count(metrics.FETCH_SUCCESS)
        path = await self._store((name, checksum), body)
        log.info("fetched Wasm module %s (sha256 %s) into %s", url, checksum, path)
        return checksum, path

    async def _prepare(self, url: str, options: GetOptions, deadline: float) -> PreparedModule:
        reference = url[len(OCI_PREFIX) :]
        host = reference.partition("/")[0]
        fetcher = self._image_fetcher(
            guard=self._guard,
            max_bytes=self._settings.max_binary_bytes,
            insecure=self._settings.insecure(host),
            pull_secret=options.pull_secret,
        )
        return await self._counted(
            _bounded(fetcher.prepare(reference), deadline, url, metrics.MANIFEST_FAILURE)
        )

    async def _counted(self, work: Coroutine[Any, Any, Any]) -> Any:
        """``work``'s result; a failure is counted under its reason and raised as ``FetchError``."""
        try:
            return await work
        except FetchError as err:
            self._count(err.reason)
            raise

    def _count(self, result: str) -> None:
        self._metrics.remote_fetches.labels(result=result).inc()

    async def _store(self, key: ModuleKey, body: bytes | bytearray) -> Path:
        module = self._cached(key)
        if module is not None:
            self._touch(module)
            return module.path
        path = self._dir / key[0] / f"{key[1]}.wasm"
        try:
            await asyncio.to_thread(_write_module, path, body)
        except OSError as err:
            raise FetchError(
                f"cannot write the Wasm module to the cache directory {self._dir} ({path}): {describe(err)}"
            ) from None
        self._modules[key] = _Module(path, self._clock())
        self._metrics.cache_entries.set(len(self._modules))
        return path

    # --- purging ---

    async def _purge_loop(self) -> None:
        interval = (self._settings.purge_interval or DEFAULT_PURGE_INTERVAL).total_seconds()
        while True:
            await asyncio.sleep(interval)
            try:
                await self.purge()
            except Exception:  # never let one bad pass end purging
                log.exception("Wasm module cache purge failed")

    async def purge(self) -> None:
        """Remove the modules unused for ``module_expiry`` (files, and the URLs that gave them)."""
        expiry = (self._settings.module_expiry or DEFAULT_MODULE_EXPIRY).total_seconds()  # 0: Istio's default
        now = self._clock()
        removed = False
        for key, module in list(self._modules.items()):
            if now - module.last <= expiry:
                continue
            try:
                module.path.unlink(missing_ok=True)
            except OSError as err:
                log.error("failed to purge Wasm module %s: %s", module.path, describe(err))
                continue
            with contextlib.suppress(OSError):
                module.path.parent.rmdir()  # only if no other checksum of this module is left
            self._forget(key)
            removed = True
            log.debug("removed stale Wasm module %s", module.path)
        if removed:
            await self._save_index()

    def _forget(self, key: ModuleKey) -> None:
        self._modules.pop(key, None)
        for url, record in list(self._urls.items()):
            if (record.module, record.checksum) == key:
                del self._urls[url]
        self._metrics.cache_entries.set(len(self._modules))

    # --- on disk ---

    def _load(self) -> None:
        """The modules and URL records an earlier run left (in a thread: it reads the disk)."""
        try:
            children = list(self._dir.iterdir())
        except FileNotFoundError:
            return
        except OSError as err:
            log.warning("cannot read the Wasm module cache directory %s: %s", self._dir, describe(err))
            return
        for child in children:
            if _is_temporary(child):
                with contextlib.suppress(OSError):
                    child.unlink()
            elif _HEX64.fullmatch(child.name) and child.is_dir():
                self._load_module_dir(child)
        self._load_index()
        if self._modules:
            log.info("Wasm module cache: %d modules from an earlier run in %s", len(self._modules), self._dir)

    def _load_module_dir(self, directory: Path) -> None:
        with contextlib.suppress(OSError):
            for file in directory.iterdir():
                if _is_temporary(file):
                    with contextlib.suppress(OSError):
                        file.unlink()  # a write an earlier run did not finish
                elif file.suffix == ".wasm" and _HEX64.fullmatch(file.stem):
                    with contextlib.suppress(OSError):
                        self._modules[(directory.name, file.stem)] = _Module(file, file.stat().st_mtime)

    def _load_index(self) -> None:
        path = self._dir / INDEX_NAME
        try:
            document = json.loads(path.read_bytes())
            if document.get("version") != INDEX_VERSION:
                raise ValueError(f"version {document.get('version')!r}")
            for url, entry in document["urls"].items():
                record = _UrlRecord(
                    str(entry["module"]),
                    str(entry["checksum"]),
                    {str(k): str(v) for k, v in entry["resource_versions"].items()},
                )
                if (record.module, record.checksum) in self._modules:
                    self._urls[str(url)] = record
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            self._urls.clear()
            log.warning("ignoring the unreadable Wasm module index %s: %s", path, err)

    async def _save_index(self) -> None:
        """Write the URL records (one writer at a time, each writing the latest state)."""
        async with self._index_lock:
            document = {
                "version": INDEX_VERSION,
                "urls": {
                    url: {"module": r.module, "checksum": r.checksum, "resource_versions": dict(r.versions)}
                    for url, r in self._urls.items()
                },
            }
            data = json.dumps(document, indent=1, sort_keys=True).encode()
            try:
                await asyncio.to_thread(_write_index, self._dir, data)
            except OSError as err:
                log.warning("cannot save the Wasm module index in %s: %s", self._dir, describe(err))


def module_name(url: str) -> str:
    """What a module's directory is named after: the URL, or for an image its repository
    (``oci://host[:port]/repo``) without tag or digest."""
    if not url.startswith(OCI_PREFIX):
        return url
    reference = url[len(OCI_PREFIX) :].partition("@")[0]
    host, slash, path = reference.partition("/")
    if not slash or not path:
        return url
    head, sep, last = path.rpartition("/")
    repository = (head + sep + last.partition(":")[0]) if ":" in last else path
    return f"{OCI_PREFIX}{host}/{repository}"


def ignores_resource_version(policy: PullPolicy, url: str) -> bool:
    """Whether the module cached for ``url`` stands whatever the resource version (Istio's
    ``shouldIgnoreResourceVersion``); an untagged image counts as tagged ``latest``."""
    if policy is PullPolicy.ALWAYS:
        return False
    if policy is PullPolicy.IF_NOT_PRESENT:
        return True
    if not url.startswith(OCI_PREFIX):
        return True
    reference = url[len(OCI_PREFIX) :]
    if "@" in reference:
        return True  # pinned by digest
    last = reference.partition("/")[2].rpartition("/")[2]
    tag = last.partition(":")[2] if ":" in last else "latest"
    return tag != "latest"


async def _bounded(work: Coroutine[Any, Any, Any], deadline: float, url: str, reason: str) -> Any:
    """``work`` by ``deadline`` (loop time); a timeout, or a stray HTTP/socket error, is a ``FetchError``."""
    try:
        async with asyncio.timeout_at(deadline):
            return await work
    except TimeoutError:
        raise FetchError(f"could not fetch Wasm OCI image {url}: timed out", reason) from None
    except (HTTPError, OSError) as err:
        raise FetchError(f"could not fetch Wasm OCI image {url}: {describe(err)}", reason) from None


def _hash(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def _is_temporary(path: Path) -> bool:
    """A temporary file of ``write_atomic`` (``.<name>.<random>.tmp``)."""
    return path.name.startswith(".") and path.name.endswith(".tmp")


def _write_module(path: Path, body: bytes | bytearray) -> None:
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    write_atomic(path, body, 0o644)


def _write_index(directory: Path, data: bytes) -> None:
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    write_atomic(directory / INDEX_NAME, data, 0o644)
