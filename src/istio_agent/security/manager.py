"""The secret manager: where each SDS secret comes from, caching, rotation and OUTPUT_CERTS.

Sources, in Istio's order (Istio: security/pkg/nodeagent/cache/secretcache.go): mounted files, the in-memory workload
certificate, then a CSR to the CA. Two deliberate differences from Istio, both in
docs/compatibility.md:

* Rotation renews *before* dropping the current certificate. Istio clears its cache when the
  grace period starts and lets the next SDS request sign a new one; if the CA is down then,
  every request fails. Here the current certificate keeps being served (until it expires) while
  a background task retries the CA with backoff; subscribers are pushed once the new one exists.
* The CA's answer is checked (chain of two or more, leaf for our key and our identity) before
  anything is cached or served.
"""

from __future__ import annotations

import asyncio
import random
import stat
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Protocol, TypeVar

from istio_agent import goformat
from istio_agent.backoff import ExponentialBackoff
from istio_agent.config.security import FILE_LOAD_TIMEOUT, SecuritySettings, os_ca_bundle
from istio_agent.filewatch import FileWatcher
from istio_agent.log import report_failure, scope
from istio_agent.metrics import Registry
from istio_agent.pem import (
    PemError,
    concat_certs,
    leaf_not_after,
    merge_root_bundles,
    parse_certificate,
    parse_root_bundle,
    public_keys_match,
    validate_signed_chain,
)
from istio_agent.security.keys import KeyOptions, generate_csr
from istio_agent.security.model import ROOT_CERT, WORKLOAD_KEY_CERT, CAError, SecretError, SecretItem
from istio_agent.security.output import write_output_certs
from istio_agent.security.resources import FileResource, parse_file_resource

log = scope("cache")
T = TypeVar("T")


class _ManagerMetrics:
    """The secret manager's metrics (Istio's names)."""

    def __init__(self, registry: Registry) -> None:
        self.cert_expiry = registry.gauge(
            "cert_expiry_seconds", "Seconds until the workload certificate expires", ["resource_name"]
        )
        self.file_secret_failures = registry.counter(
            "num_file_secret_failures_total", "Failures to load a file-mounted secret", ["resource_name"]
        )
        self.ca_refused = registry.counter(
            "ca_response_rejected",
            "CA answers refused by the agent's checks (wrong key, identity, short chain)",
        )
        self.rotations = registry.counter("cert_rotations", "Workload certificates renewed before expiry")
        self.rotation_failures = registry.counter(
            "cert_rotation_failures", "Failed attempts to renew the workload certificate"
        )


class CAClient(Protocol):
    """What the manager needs from a CA: sign a CSR, get the PEM chain (leaf first, root last).

    ``csr_sign`` raises CAError when the CA cannot sign (unreachable, refused, a bad answer).
    """

    async def csr_sign(self, csr_pem: bytes, ttl: timedelta) -> list[str]: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class HeldSecret:
    """What the agent holds for one resource name, for operators (``/debug/secrets``): never the key.

    ``certificates`` is the chain of a key/cert secret or the bundle of a root; ``source`` is the
    file it came from, or None when the CA signed it.
    """

    resource_name: str
    certificates: bytes
    is_root: bool
    source: Path | None
    since: datetime


@dataclass(frozen=True)
class _Workload:
    """The one cached workload certificate (Istio caches exactly one)."""

    chain: bytes
    key: bytes
    root: bytes
    created: datetime
    expires: datetime


class SecretManager:
    """Produces SDS secrets by name and tells subscribers when one changed.

    ``file_load_timeout`` bounds how long a half-written mounted file is retried (Istio: 10 s).
    """

    def __init__(
        self,
        settings: SecuritySettings,
        ca_client: CAClient | None,
        *,
        file_load_timeout: float = FILE_LOAD_TIMEOUT.total_seconds(),
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        rng: Callable[[], float] = random.random,
        backoff: Callable[[], ExponentialBackoff] = ExponentialBackoff,
        registry: Registry,
    ) -> None:
        self._settings = settings
        self._metrics = _ManagerMetrics(registry)
        self._ca = ca_client
        self._file_load_timeout = file_load_timeout
        self._now = now
        self._rng = rng
        self._new_backoff = backoff
        self._key_options = KeyOptions.from_settings(settings)
        self._callbacks: list[Callable[[str], None]] = []
        self._watcher = FileWatcher(self._on_file_changed, debounce=settings.file_debounce, registry=registry)
        self._workload: _Workload | None = None
        self._last_root: bytes = b""
        self._trust_bundle: bytes = b""
        self._generate_lock = asyncio.Lock()
        self._rotation_timer: asyncio.TimerHandle | None = None
        self._rotation_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._output_lock = asyncio.Lock()
        self._served: dict[str, HeldSecret] = {}
        self._file_sources: dict[str, Path] = {}

    # -- lifecycle -------------------------------------------------------------------------------
    def add_update_callback(self, callback: Callable[[str], None]) -> None:
        """Register a subscriber (the SDS server) for "secret <name> changed" events."""
        self._callbacks.append(callback)

    async def start(self) -> None:
        await self._watcher.start()

    async def stop(self) -> None:
        rotation = self._rotation_task
        self._cancel_rotation()
        tasks = [*self._tasks, *([rotation] if rotation else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._watcher.stop()
        if self._ca is not None:
            await self._ca.close()

    # -- the SecretProvider API ------------------------------------------------------------------
    async def generate(self, resource_name: str) -> SecretItem:
        """Return the secret for an SDS resource name; raise SecretError with the reason."""
        item = await self._from_files(resource_name)
        source = self._file_sources.get(resource_name) if item is not None else None
        if item is None:
            item = await self._from_workload(resource_name)
        if resource_name in (WORKLOAD_KEY_CERT, ROOT_CERT) and self._settings.output_certs is not None:
            await self._write_output(item)
        self._served[resource_name] = HeldSecret(
            resource_name=resource_name,
            certificates=item.root_cert if item.is_root else item.certificate_chain,
            is_root=item.is_root,
            source=source,
            since=self._now(),
        )
        return item

    def held(self) -> list[HeldSecret]:
        """The secrets the agent holds now, by resource name, without keys (a read-only snapshot).

        What it last served, except that a CA-signed ``default`` and ``ROOTCA`` are the cached
        workload certificate: after a rotation that is the new one even if no push reached Envoy
        yet, which is exactly the mismatch an operator looks for.
        """
        held = dict(self._served)
        workload = self._workload
        if workload is not None:
            for name in (WORKLOAD_KEY_CERT, ROOT_CERT):
                if name in held and held[name].source is None:
                    item = self._item(name, workload)
                    held[name] = HeldSecret(
                        resource_name=name,
                        certificates=item.root_cert if item.is_root else item.certificate_chain,
                        is_root=item.is_root,
                        source=None,
                        since=workload.created if name == WORKLOAD_KEY_CERT else held[name].since,
                    )
        return [held[name] for name in sorted(held)]

    @property
    def output_dir(self) -> Path | None:
        """OUTPUT_CERTS, where the agent writes the workload's key, chain and root for other consumers."""
        return self._settings.output_certs

    async def prewarm(self) -> None:
        """Fetch ``default`` then ``ROOTCA`` before Envoy asks, retrying with backoff until both succeed.

        This also guarantees OUTPUT_CERTS is written even when nothing ever subscribes over SDS.
        """
        backoff = self._new_backoff()
        for name, what in ((WORKLOAD_KEY_CERT, "certificate"), (ROOT_CERT, "root certificate")):
            while True:
                try:
                    await self.generate(name)
                    break
                except SecretError as err:
                    delay = backoff.next_delay()
                    log.warning("failed to warm %s: %s (retrying in %.1fs)", what, err, delay)
                    await asyncio.sleep(delay)
            backoff.reset()

    def update_trust_bundle(self, bundle: bytes) -> None:
        """Extra trust anchors (ProxyConfig / PCDS): re-push ROOTCA and force a re-sign of ``default``."""
        if bundle == self._trust_bundle:
            return
        self._trust_bundle = bundle
        self._notify(ROOT_CERT)
        self._workload = None
        self._cancel_rotation()
        self._notify(WORKLOAD_KEY_CERT)

    # -- files -----------------------------------------------------------------------------------
    def _output_is_cert_dir(self) -> bool:
        """An agent writing OUTPUT_CERTS into the mounted-cert dir must not re-read its own output."""
        output = self._settings.output_certs
        return output is not None and self._settings.cert_chain_file.parent.resolve() == output.resolve()

    async def _from_files(self, name: str) -> SecretItem | None:
        settings = self._settings
        try:
            resource = parse_file_resource(name)
        except ValueError as err:
            raise SecretError(str(err)) from None
        if resource is not None and resource.ca_path == "system":
            bundle = os_ca_bundle()
            # Istio falls through to the CA path here (serving the workload cert as a "root"); we refuse.
            if bundle is None:
                raise SecretError("file-root:system requested but no OS CA bundle was found")
            resource = FileResource(ca_path=str(bundle))
        try:
            if resource is not None and resource.is_root:
                return await self._root_from_file(name, self._resolve(resource.ca_path), merge=False)
            if resource is not None and resource.is_key_cert:
                return await self._key_cert_from_files(
                    name, self._resolve(resource.cert_path), self._resolve(resource.key_path)
                )
            if self._output_is_cert_dir():
                return None
            if name == ROOT_CERT and _non_empty(settings.root_cert_file):
                return await self._root_from_file(name, settings.root_cert_file, merge=True)
            if (
                name == WORKLOAD_KEY_CERT
                and _non_empty(settings.cert_chain_file)
                and _non_empty(settings.key_file)
            ):
                return await self._key_cert_from_files(name, settings.cert_chain_file, settings.key_file)
        except SecretError:
            self._metrics.file_secret_failures.labels(resource_name=name).inc()
            raise
        return None

    def _resolve(self, path: str) -> Path:
        candidate = Path(path)
        return candidate if candidate.is_absolute() else self._settings.workdir / candidate

    async def _root_from_file(self, name: str, path: Path, *, merge: bool) -> SecretItem:
        def load() -> bytes:
            data = _read_mounted(path)
            try:
                return parse_root_bundle(data, str(path))
            except PemError as err:
                raise _Unloadable(path, str(err)) from None

        root = await self._retry_file(load)
        self._watcher.watch(name, [path])
        self._file_sources[name] = path
        if merge:
            self._last_root = root
            root = merge_root_bundles(self._trust_bundle, root)
        return SecretItem(resource_name=name, root_cert=root)

    async def _key_cert_from_files(self, name: str, cert_path: Path, key_path: Path) -> SecretItem:
        def load() -> tuple[bytes, bytes, datetime]:
            chain, key = _read_mounted(cert_path), _read_mounted(key_path)
            try:
                certificate = parse_certificate(chain)
            except PemError as err:
                raise _Unloadable(cert_path, str(err)) from None
            try:
                matches = public_keys_match(key, certificate)
            except PemError as err:
                raise _Unloadable(key_path, str(err)) from None
            if not matches:  # the pair is being replaced one file at a time
                raise _Unloadable(key_path, "does not match the certificate's public key", transient=True)
            return chain, key, certificate.not_valid_after_utc

        chain, key, expires = await self._retry_file(load)
        # Beyond Istio: the key file is watched too, so a key-only rotation is pushed.
        self._watcher.watch(name, [cert_path, key_path])
        self._file_sources[name] = cert_path
        return SecretItem(
            resource_name=name, certificate_chain=chain, private_key=key, created=self._now(), expires=expires
        )

    async def _retry_file(self, load: Callable[[], T]) -> T:
        """Load mounted files, retrying (as Istio, up to ``file_load_timeout``) only while a writer may
        be half-way through them; a file that can never load is an error at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._file_load_timeout
        delay = max(self._settings.file_debounce.total_seconds(), 0.01)
        while True:
            try:
                return await asyncio.to_thread(load)
            except _Unloadable as err:
                if not err.transient or loop.time() + delay > deadline:
                    raise SecretError(str(err)) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    # -- workload certificate --------------------------------------------------------------------
    async def _from_workload(self, name: str) -> SecretItem:
        if name not in (WORKLOAD_KEY_CERT, ROOT_CERT):
            raise SecretError(
                f"unknown resource name {name!r}: this agent serves {WORKLOAD_KEY_CERT}, {ROOT_CERT}, "
                "file-cert:<cert>~<key> and file-root:<path>"
            )
        workload = self._usable_workload()
        if workload is None:
            async with self._generate_lock:
                workload = self._usable_workload()
                if workload is None:
                    workload = await self._sign_new()
                    self._install(workload)
        return self._item(name, workload)

    def _usable_workload(self) -> _Workload | None:
        workload = self._workload
        if workload is not None and workload.expires > self._now():
            return workload
        return None

    def _item(self, name: str, workload: _Workload) -> SecretItem:
        if name == ROOT_CERT:
            return SecretItem(
                resource_name=name, root_cert=merge_root_bundles(self._trust_bundle, workload.root)
            )
        return SecretItem(
            resource_name=name,
            certificate_chain=workload.chain,
            private_key=workload.key,
            created=workload.created,
            expires=workload.expires,
        )

    async def _sign_new(self) -> _Workload:
        """Make a key and CSR, have the CA sign it, and check the answer before trusting it."""
        if self._ca is None:
            raise SecretError(
                "attempted to fetch secret, but ca client is nil (certificates are file-mounted only)"
            )
        identity = self._settings.spiffe_id
        try:
            csr, key = await asyncio.to_thread(generate_csr, identity, self._key_options)
        except ValueError as err:
            raise SecretError(f"failed to generate workload certificate: {err}") from None
        try:
            chain = await self._ca.csr_sign(csr, self._settings.secret_ttl)
        except CAError as err:  # carries the gRPC status and reason; anything else is a bug and propagates
            raise SecretError(f"failed to generate workload certificate: {err}") from None
        try:
            validate_signed_chain(chain, key, identity, now=self._now())
            expires = leaf_not_after(concat_certs(chain[:1]))
        except PemError as err:
            self._metrics.ca_refused.inc()
            raise SecretError(f"failed to generate workload certificate: CA answer refused: {err}") from None
        workload = _Workload(
            chain=concat_certs(chain),
            key=key,
            root=chain[-1].encode(),
            created=self._now(),
            expires=expires,
        )
        log.info("generated new workload certificate for %s, expires %s", identity, expires.isoformat())
        return workload

    def _install(self, workload: _Workload) -> None:
        """Cache a fresh certificate, schedule its renewal, announce a new root."""
        self._workload = workload
        self._metrics.cert_expiry.labels(resource_name=WORKLOAD_KEY_CERT).set(
            max(0.0, (workload.expires - self._now()).total_seconds())
        )
        self._schedule_rotation(workload)
        if workload.root != self._last_root:
            self._last_root = workload.root
            self._notify(ROOT_CERT)
        if self._settings.output_certs is not None:
            # A fresh CSR writes all three files; the root un-merged, as Istio.
            item = SecretItem(
                resource_name=WORKLOAD_KEY_CERT,
                certificate_chain=workload.chain,
                private_key=workload.key,
                root_cert=workload.root,
            )
            self._spawn(self._write_output(item))

    # -- rotation --------------------------------------------------------------------------------
    def rotation_delay(self, created: datetime, expires: datetime) -> timedelta:
        """When to renew: at ``ratio`` of the lifetime left, the ratio jittered by ±jitter (as Istio's secret cache)."""
        settings = self._settings
        jitter = self._rng() * settings.grace_period_ratio_jitter * (1 if self._rng() < 0.5 else -1)
        ratio = min(1.0, max(0.0, settings.grace_period_ratio + jitter))
        lifetime = expires - created
        return max(timedelta(0), (expires - lifetime * ratio) - self._now())

    def _schedule_rotation(self, workload: _Workload) -> None:
        # Only the timer: this may run inside the rotation task itself, which must finish its push.
        if self._rotation_timer is not None:
            self._rotation_timer.cancel()
        delay = self.rotation_delay(workload.created, workload.expires).total_seconds()
        loop = asyncio.get_running_loop()
        self._rotation_timer = loop.call_later(delay, self._start_rotation, workload)

    def _cancel_rotation(self) -> None:
        if self._rotation_timer is not None:
            self._rotation_timer.cancel()
            self._rotation_timer = None
        if self._rotation_task is not None:
            self._rotation_task.cancel()
            self._rotation_task = None

    def _start_rotation(self, workload: _Workload) -> None:
        if self._workload is not workload:
            return  # stale: replaced meanwhile
        self._rotation_task = asyncio.get_running_loop().create_task(
            self._rotate(workload), name="cert-rotation"
        )
        self._rotation_task.add_done_callback(report_failure(log, "workload certificate rotation"))

    async def _rotate(self, old: _Workload) -> None:
        """Renew with backoff; keep serving ``old`` until a new certificate is in hand."""
        backoff = self._new_backoff()
        while self._workload is old:
            try:
                async with self._generate_lock:
                    if self._workload is not old:
                        return
                    new = await self._sign_new()
                    self._install(new)
                self._metrics.rotations.inc()
                log.info(
                    "rotated workload certificate; the previous one %s", _expiry(old.expires, self._now())
                )
                self._notify(WORKLOAD_KEY_CERT)
                return
            except SecretError as err:
                self._metrics.rotation_failures.inc()
                delay = backoff.next_delay()
                log.warning(
                    "certificate rotation failed: %s; retrying in %.1fs (the current certificate %s)",
                    err,
                    delay,
                    _expiry(old.expires, self._now()),
                )
                await asyncio.sleep(delay)

    # -- events and output -----------------------------------------------------------------------
    def _notify(self, name: str) -> None:
        for callback in self._callbacks:
            try:
                callback(name)
            except Exception:
                log.exception("secret update callback failed for %s", name)

    def _on_file_changed(self, resource_name: str) -> None:
        log.info("file-mounted secret %s changed, pushing", resource_name)
        self._notify(resource_name)

    def _spawn(self, coro: object) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(report_failure(log, "writing OUTPUT_CERTS"))

    async def _write_output(self, item: SecretItem) -> None:
        directory = self._settings.output_certs
        if directory is None:
            return
        async with self._output_lock:
            try:
                written = await asyncio.to_thread(
                    write_output_certs, directory, item, self._settings.output_world_readable
                )
            except OSError as err:
                log.error("failed to write certificates to %s: %s", directory, err)
                return
        if written:
            log.info("wrote %s to %s", ", ".join(written), directory)


def _non_empty(path: Path) -> bool:
    """Istio's existence check for mounted certs: readable and non-empty."""
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def _expiry(expires: datetime, now: datetime) -> str:
    """``expires at <time> (in 11h59m59s)``, or ``expired at <time> (5s ago)`` once it has."""
    left = (expires - now).total_seconds()
    if left > 0:
        return f"expires at {expires.isoformat()} (in {goformat.duration(left)})"
    return f"expired at {expires.isoformat()} ({goformat.duration(-left)} ago)"


class _Unloadable(Exception):
    """Why a mounted file cannot be served; ``transient`` when a writer may be half-way through it."""

    def __init__(self, path: Path, reason: str, *, transient: bool = False) -> None:
        super().__init__(f"failed to load {path}: {reason}")
        self.transient = transient


def _read_mounted(path: Path) -> bytes:
    """A mounted certificate or key file's bytes.

    Missing, empty, or ending inside a PEM block: a writer may be about to finish it (transient).
    Not a regular file (a directory; a FIFO or device, whose read could block a thread for good) or
    unreadable: final.
    """
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise _Unloadable(path, "not a regular file")
        data = path.read_bytes()
    except FileNotFoundError:
        raise _Unloadable(path, "no such file or directory", transient=True) from None
    except OSError as err:
        raise _Unloadable(path, (err.strerror or str(err)).lower()) from None
    if not data.strip():
        raise _Unloadable(path, "file is empty", transient=True)
    if data.rfind(b"-----BEGIN ") > data.rfind(b"-----END "):
        raise _Unloadable(path, "a PEM block is cut short", transient=True)
    return data
