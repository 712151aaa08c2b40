"""The agent's DNS proxy as one unit: settings in, listeners up, name tables in from NDS.

Beyond Istio: every table that arrives is also written to disk (atomically), and a restarted agent
loads it before it binds, so mesh names resolve while the control plane is still unreachable.
Readiness keeps Istio's meaning: it waits for a table from the control plane in this run.
"""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from istio_agent.config import ConfigError
from istio_agent.config.dns import DnsSettings, split_host_port
from istio_agent.dns.cache import AnswerCache
from istio_agent.dns.resolvconf import ResolvConf, read_resolv_conf
from istio_agent.dns.server import DnsResolver, DnsServer
from istio_agent.dns.table import LookupTable
from istio_agent.dns.upstream import Forwarder
from istio_agent.files import write_atomic
from istio_agent.log import scope
from istio_agent.metrics import Registry
from istio_agent.protos import nds_pb2

log = scope("dns")

BUILD_IN_THREAD_FROM = 2000
"""Hosts from which a table is built in a worker thread (10,000 take about 0.3 s of CPU)."""
SAVED_TABLE = Path("var/lib/istio/data/dns-name-table.pb")
"""Where the last name table is kept, relative to the agent's working directory: on the pod's
``istio-data`` volume (an emptyDir at ``/var/lib/istio/data``), the one place in an injected pod that
is writable and outlives a restart of the container. A table an older agent kept outside it is not
read: the control plane sends a fresh one on connect."""


class CollectorPause:
    """Keeps Python's cyclic garbage collector off while any name table is being built.

    A table of 10,000 hosts is some 300,000 small acyclic objects; with the collector on, it rescans
    the growing heap again and again and the build takes more than twice as long. The collector is a
    process-wide switch, so only the event loop's thread flips it (a build in a worker thread must
    not), and overlapping builds keep it off until the last one ends.
    """

    def __init__(self) -> None:
        self._builds = 0
        self._collector_was_enabled = False

    def __enter__(self) -> None:
        if self._builds == 0:
            self._collector_was_enabled = gc.isenabled()
            gc.disable()
        self._builds += 1

    def __exit__(self, *exc: object) -> None:
        self._builds -= 1
        if self._builds == 0 and self._collector_was_enabled:
            gc.enable()


class DnsStartError(OSError):
    """The DNS proxy cannot start (Istio: "failed to start local DNS server: ..."); fails the agent's start."""


def listen_addresses(listen: str, resolv: ResolvConf) -> list[tuple[str, int]]:
    """``localhost`` follows the nameservers' address families; anything else is bound as given."""
    host, port = split_host_port(listen)  # validated with the settings
    if host != "localhost":
        return [(host or "0.0.0.0", port)]
    families = {":" in server for server, _ in resolv.nameservers}
    if not families:
        return [("127.0.0.1", port)]  # Go's "localhost" resolves to the IPv4 loopback first
    return [
        address for v6, address in ((False, ("127.0.0.1", port)), (True, ("::1", port))) if v6 in families
    ]


class DnsProxy:
    """Owns the resolver, its listeners and the current lookup table."""

    def __init__(self, settings: DnsSettings, *, workdir: Path | None = None, registry: Registry) -> None:
        self._settings = settings
        self._registry = registry
        self._saved = (workdir or Path.cwd()) / SAVED_TABLE
        try:
            self._resolv = read_resolv_conf(settings.resolv_conf)
        except ConfigError as err:
            raise DnsStartError(f"failed to start local DNS server: {err}") from None
        cache = AnswerCache(registry=registry) if settings.cache else None
        self._forwarder = Forwarder(
            self._resolv.nameservers,
            parallel=settings.forward_parallel,
            timeout=settings.forward_timeout,
            retries=settings.forward_retries,
            cache=cache,
            registry=registry,
        )
        self.resolver = DnsResolver(self._forwarder, respond_before_sync=settings.respond_before_sync)
        self.server: DnsServer | None = None
        self.name_table: nds_pb2.NameTable | None = None
        """The last table from the control plane in this run (None until one arrived)."""
        self._generation = 0
        self._building: set[asyncio.Task[None]] = set()
        self._saving: set[asyncio.Task[None]] = set()
        self._collector_pause = CollectorPause()
        self._save_order = asyncio.Lock()

    @property
    def ready(self) -> bool:
        return self.name_table is not None

    async def start(self) -> None:
        """Load any saved table, then bind UDP and TCP on every listen address."""
        self._load_saved()
        addresses = listen_addresses(self._settings.listen_address, self._resolv)
        server = DnsServer(self.resolver, addresses, registry=self._registry)
        try:
            await server.start()
        except OSError as err:
            raise DnsStartError(f"failed to start local DNS server: {err.strerror or err}") from None
        self.server = server
        upstreams = ", ".join(f"{host}:{port}" for host, port in self._resolv.nameservers) or "none"
        mode = "in parallel" if self._settings.forward_parallel else "one after another"
        log.info("DNS upstreams (%s): %s", mode, upstreams)

    def update(self, name_table: nds_pb2.NameTable) -> asyncio.Task[None] | None:
        """A new table from NDS replaces the old one whole (as in Istio), and is saved for the next start.

        A big table is built in a worker thread while the old one keeps answering; the returned task
        ends when the new one answers (None: it already does). A newer table always wins over an
        older one still being built.
        """
        self._generation += 1
        generation = self._generation
        if len(name_table.table) < BUILD_IN_THREAD_FROM:
            with self._collector_pause:
                table = self._build(name_table)
            self._install(name_table, table, generation)
            return None
        task = asyncio.get_running_loop().create_task(self._build_in_thread(name_table, generation))
        self._building.add(task)
        task.add_done_callback(self._building.discard)
        return task

    async def _build_in_thread(self, name_table: nds_pb2.NameTable, generation: int) -> None:
        try:
            with self._collector_pause:
                table = await asyncio.to_thread(self._build, name_table)
        except Exception:  # the old table keeps answering; the next push tries again
            log.exception("cannot build the DNS name table (%d hosts)", len(name_table.table))
            return
        self._install(name_table, table, generation)

    def _install(self, name_table: nds_pb2.NameTable, table: LookupTable, generation: int) -> None:
        if generation != self._generation:
            return  # a newer table arrived while this one was being built
        self.resolver.table = table
        self.name_table = name_table
        self._save(name_table)

    def ndsz(self) -> dict[str, Any] | None:
        """The ``/debug/ndsz`` view, or None before the first table."""
        table = self.resolver.table
        return table.ndsz() if table is not None and self.name_table is not None else None

    async def stop(self) -> None:
        for task in list(self._building):
            task.cancel()
        await asyncio.gather(*self._building, return_exceptions=True)
        if self.server is not None:
            await self.server.stop()
        self._forwarder.close()
        await asyncio.gather(*self._saving)  # the last table reaches the disk before the agent exits

    def _build(self, name_table: nds_pb2.NameTable) -> LookupTable:
        return LookupTable.build(
            name_table,
            proxy_namespace=self._settings.proxy_namespace,
            proxy_domain=self._settings.proxy_domain,
            search_domains=self._resolv.search,
        )

    def _save(self, name_table: nds_pb2.NameTable) -> None:
        """Keep the table for the next start; written in a thread so a disk sync never delays an answer."""
        task = asyncio.get_running_loop().create_task(self._write_saved(name_table.SerializeToString()))
        self._saving.add(task)
        task.add_done_callback(self._saving.discard)

    async def _write_saved(self, data: bytes) -> None:
        async with self._save_order:  # first come, first written: the newest table is the one left on disk
            try:
                await asyncio.to_thread(self._write_saved_file, data)
            except OSError as err:
                log.warning("cannot save the DNS name table to %s: %s", self._saved, err)

    def _write_saved_file(self, data: bytes) -> None:
        self._saved.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self._saved, data)

    def _load_saved(self) -> None:
        try:
            data = self._saved.read_bytes()
        except FileNotFoundError:
            return
        except OSError as err:
            log.warning("cannot read the saved DNS name table %s: %s", self._saved, err)
            return
        saved = nds_pb2.NameTable()
        try:
            saved.ParseFromString(data)
            with self._collector_pause:
                self.resolver.table = self._build(saved)
        except (DecodeError, ValueError) as err:
            log.warning("ignoring the saved DNS name table %s: %s", self._saved, err)
            return
        log.info(
            "answering from the saved DNS name table (%d hosts) until istiod sends one", len(saved.table)
        )
