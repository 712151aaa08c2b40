"""The Agent: builds the subsystems from settings, runs them, and stops them in reverse order.

Start order follows Istio's agent: secrets and the SDS server, then the xDS proxy on
``./etc/istio/proxy/XDS``, then Envoy on a generated bootstrap (so everything Envoy needs is
listening before it starts). Stop order is the reverse, with Envoy drained first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from istio_agent.bootstrap.envoy import write_bootstrap
from istio_agent.config import ConfigError, ProxyConfig, SecuritySettings, XdsSettings
from istio_agent.config.bootstrap import BootstrapSettings
from istio_agent.config.dns import DnsSettings
from istio_agent.config.security import CERT_CHAIN_FILE, CRL_PATH, KEY_FILE, ROOT_CERT_FILE
from istio_agent.config.status import StatusSettings
from istio_agent.envoy.process import EnvoyProcess
from istio_agent.envoy.supervisor import EnvoySupervisor
from istio_agent.log import scope
from istio_agent.metrics import REGISTRY
from istio_agent.protos import nds_pb2
from istio_agent.security.caclient import CitadelClient
from istio_agent.security.manager import SecretManager
from istio_agent.security.sds import SdsServer
from istio_agent.security.uds import remove_if_stale
from istio_agent.xds.handlers import NameTableHandler, ProxyConfigHandler
from istio_agent.xds.proxy import TypeHandler, XdsProxy

if TYPE_CHECKING:  # imported when used: not needed to start Envoy
    from istio_agent.dns.proxy import DnsProxy
    from istio_agent.health.checker import HealthChecker
    from istio_agent.health.config import ReadinessProbeConfig
    from istio_agent.status.lazy import LazyHandler
    from istio_agent.status.metrics import MetricsMerger
    from istio_agent.status.probes import AppProbes
    from istio_agent.status.readiness import Readiness
    from istio_agent.status.server import StatusServer

log = scope("agent")


@dataclass(frozen=True)
class AgentSettings:
    """What to run. ``xds=None`` runs no xDS proxy and ``bootstrap=None`` no Envoy (certificates only)."""

    security: SecuritySettings
    proxy_config: ProxyConfig = field(default_factory=ProxyConfig)
    xds: XdsSettings | None = None
    bootstrap: BootstrapSettings | None = None
    status: StatusSettings | None = None
    health: ReadinessProbeConfig | None = None  # ProxyConfig readinessProbe: VM health over xDS
    dns: DnsSettings | None = None  # the DNS proxy runs when dns.enabled
    workdir: Path = field(default_factory=Path.cwd)  # where state is kept (the DNS proxy's last name table)
    serve_sds: bool = True  # Istio's DISABLE_ENVOY (proxyless) runs no SDS server


@dataclass(frozen=True)
class SdsPlan:
    """Where the SDS server listens and where certificates come from (as Istio decides in pkg/istio-agent/agent.go)."""

    socket_path: Path
    serve_only_files: bool
    settings: SecuritySettings

    @property
    def uses_ca(self) -> bool:
        return not self.serve_only_files and not self.settings.file_mounted_certs


async def plan_sds(settings: SecuritySettings) -> SdsPlan:
    """Decide the SDS socket and certificate source, as Istio's agent does at start-up."""
    configured = settings.sds_socket_path
    if not await remove_if_stale(configured) and configured.exists():
        log.info(
            "SDS socket %s is served by another process; serving only file-mounted certificates", configured
        )
        return SdsPlan(settings.files_socket_path, serve_only_files=True, settings=settings)
    if configured != settings.default_sds_socket_path:
        raise ConfigError(
            f"agent configured for non-default SDS socket path: {configured} but no socket found"
        )
    credentials = settings.workload_credentials_dir
    files = [credentials / CERT_CHAIN_FILE, credentials / KEY_FILE, credentials / ROOT_CERT_FILE]
    if all(path.exists() for path in files):
        log.info("using workload certificates mounted at %s", credentials)
        settings = dataclasses.replace(
            settings,
            file_mounted_certs=True,
            cert_chain_file=files[0],
            key_file=files[1],
            root_cert_file=files[2],
        )
    return SdsPlan(configured, serve_only_files=False, settings=settings)


class Agent:
    """One workload's agent. ``start()`` brings everything up; ``stop()`` tears it down."""

    def __init__(self, settings: AgentSettings) -> None:
        self._settings = settings
        self.secret_manager: SecretManager | None = None
        self.sds_server: SdsServer | None = None
        self.xds_proxy: XdsProxy | None = None
        self.name_table: NameTableHandler | None = None
        self.dns: DnsProxy | None = None
        self.envoy: EnvoySupervisor | None = None
        self.readiness: Readiness | None = None
        self.status_server: StatusServer | None = None
        self.stop_requested = asyncio.Event()
        """Set by ``/quitquitquit``: whoever runs the agent should stop it."""
        self._started_at = time.monotonic()
        self._skip_drain = False
        self._closers: list[LazyHandler] = []
        self._prewarm: asyncio.Task[None] | None = None
        self._health: tuple[HealthChecker, asyncio.Task[None]] | None = None

    async def start(self) -> None:
        if self._settings.dns is not None and self._settings.dns.enabled:
            await self._start_dns(self._settings.dns)  # as Istio: bound before anything else
        plan = await plan_sds(self._settings.security)
        ca_client = None
        if plan.uses_ca:
            ca_client = CitadelClient.from_settings(plan.settings)
        manager = SecretManager(plan.settings, ca_client)
        self.secret_manager = manager
        await manager.start()
        if self._settings.serve_sds:
            crl = Path(CRL_PATH) if plan.settings.enable_ca_crl else None
            self.sds_server = SdsServer(manager, plan.socket_path, crl_path=crl)
            manager.add_update_callback(self.sds_server.on_secret_update)
            await self.sds_server.start()
        if plan.uses_ca:
            self._prewarm = asyncio.get_running_loop().create_task(manager.prewarm())
        if self._settings.xds is not None:
            await self._start_xds_proxy(self._settings.xds, manager)
        # Envoy first: it retries the agent's sockets on its own, and its start-up overlaps with the
        # status server's; kubelet sees 503 through 15021 until both are up.
        if self._settings.bootstrap is not None:
            await self._start_envoy(self._settings.bootstrap)
        if self._settings.status is not None and self._settings.status.enabled:
            await self._start_status_server(self._settings.status)
        if self._settings.health is not None and self.xds_proxy is not None:
            self._start_health_checks(self._settings.health, self.xds_proxy)

    async def _start_dns(self, settings: DnsSettings) -> None:
        """The DNS proxy on DNS_PROXY_ADDR; a bind or resolv.conf error fails the start (DnsStartError)."""
        from istio_agent.dns.proxy import DnsProxy

        dns = DnsProxy(settings, workdir=self._settings.workdir)
        await dns.start()
        self.dns = dns

    def _start_health_checks(self, config: ReadinessProbeConfig, proxy: XdsProxy) -> None:
        """VM health checks (WorkloadGroup readinessProbe); transitions are reported to istiod over xDS."""
        from istio_agent.health.checker import HealthChecker
        from istio_agent.health.probes import build_probers
        from istio_agent.status.readiness import EnvoyReadiness

        bootstrap = self._settings.bootstrap
        envoy = None
        host = self._settings.status.pod_ip if self._settings.status else "localhost"
        if bootstrap is not None:
            envoy = EnvoyReadiness(
                bootstrap.localhost, bootstrap.proxy_admin_port, started_at=self._started_at
            )
            host = bootstrap.ips[0] if bootstrap.ips else "localhost"
        checker = HealthChecker(
            config, build_probers(config, default_host=host, envoy=envoy), proxy.report_health
        )
        self._health = (checker, asyncio.get_running_loop().create_task(checker.run(), name="health-checks"))
        log.info("workload health checks started (every %gs)", config.period)

    async def _start_status_server(self, settings: StatusSettings) -> None:
        """Bind statusPort and serve: readiness at once, metrics and app probes built on first use.

        A bind failure is only logged (the agent runs on without a status server).
        """
        from istio_agent.http.listen import listening_socket

        try:  # the port first: connections wait in its backlog while the server loads
            sock = listening_socket(settings.host, settings.port)
        except OSError as err:
            log.error("status server %s; continuing without the status server", err)
            return
        from istio_agent.status.lazy import LazyHandler
        from istio_agent.status.readiness import DnsReadiness, EnvoyReadiness, Prober, Readiness
        from istio_agent.status.server import StatusServer

        bootstrap = self._settings.bootstrap
        probers: list[Prober] = []
        if bootstrap is not None:
            probers.append(
                EnvoyReadiness(bootstrap.localhost, bootstrap.proxy_admin_port, started_at=self._started_at)
            )
        dns, name_table = self.dns, self.name_table
        if dns is not None:  # ready once a table from this run answers (a big one is built aside)
            probers.append(DnsReadiness(lambda: dns.ready))
        elif name_table is not None:
            probers.append(DnsReadiness(lambda: name_table.ready))
        readiness = Readiness(probers)
        self.readiness = readiness
        metrics = LazyHandler(lambda: _metrics_merger(settings, bootstrap))
        probes = LazyHandler(lambda: _app_probes(settings)) if settings.app_probers else None
        server = StatusServer(
            settings.host,
            settings.port,
            readiness,
            metrics=metrics,
            app_probes=probes,
            ndsz=self.dns.ndsz if self.dns is not None else None,
            on_quit=self._quit,
            on_drain=self._drain,
            metrics_localhost_only=settings.metrics_localhost_only,
        )
        try:
            await server.start(sock)
        except OSError as err:
            sock.close()
            log.error("%s; continuing without the status server", err)
            return
        self._closers.extend(handler for handler in (metrics, probes) if handler is not None)
        self.status_server = server

    def _quit(self) -> None:
        """``/quitquitquit``: stop now, killing Envoy without a drain."""
        log.info("/quitquitquit called: stopping without draining Envoy")
        self._skip_drain = True
        self.stop_requested.set()

    async def _drain(self) -> None:
        """``/drain`` (native-sidecar preStop): drain Envoy's listeners now; the coming SIGTERM skips the wait."""
        self._skip_drain = True
        if self.envoy is not None:
            await self.envoy.drain_listeners(skip_exit=True)

    async def _start_xds_proxy(self, settings: XdsSettings, manager: SecretManager) -> None:
        handlers: list[TypeHandler] = []
        if settings.nds_enabled:
            self.name_table = NameTableHandler(_log_name_table)
            if self.dns is not None:
                self.name_table.add_listener(self.dns.update)
            handlers.append(self.name_table)
        if settings.pcds_enabled:
            handlers.append(ProxyConfigHandler(manager.update_trust_bundle))
        self.xds_proxy = XdsProxy(settings, handlers=handlers)
        await self.xds_proxy.start()
        log.info("xDS proxy on %s, upstream %s", settings.socket_path, settings.discovery_address)

    async def _start_envoy(self, settings: BootstrapSettings) -> None:
        """Start Envoy (raises EnvoyStartError when it cannot be executed); ENVOY_RESTART_ON_EXIT restarts it."""
        custom = self._settings.proxy_config.custom_config_file
        if custom:
            log.info("starting Envoy with the custom config file %s", settings.workdir / custom)

        async def launch() -> EnvoyProcess:
            if custom:
                return EnvoyProcess(settings, settings.workdir / custom, owns_bootstrap=False)
            return EnvoyProcess(settings, await asyncio.to_thread(write_bootstrap, settings))

        self.envoy = EnvoySupervisor(launch, restart=settings.restart_on_exit)
        await self.envoy.start()

    async def wait_envoy(self) -> int:
        """Wait for Envoy to exit for good (after any restarts) and return its exit status.

        Waits forever when the agent runs no Envoy.
        """
        if self.envoy is None:
            await asyncio.Event().wait()
        assert self.envoy is not None
        return await self.envoy.wait()

    async def stop(self, cause: str = "received termination signal") -> None:
        if self._health is not None:
            checker, task = self._health
            checker.stop()
            await asyncio.gather(task, return_exceptions=True)
        if self.readiness is not None:
            self.readiness.terminate(cause)  # readiness fails at once
        if self.status_server is not None:
            await self.status_server.close_listener()  # as Istio: 15020 refuses during the drain
        if self.envoy is not None:  # also ends a restart backoff (ENVOY_RESTART_ON_EXIT)
            await self.envoy.drain_and_stop(graceful_drain=not self._skip_drain)
        if self.status_server is not None:
            await self.status_server.stop()
        for closer in self._closers:
            await closer.close()
        if self.xds_proxy is not None:
            await self.xds_proxy.stop()
        if self._prewarm is not None:
            self._prewarm.cancel()
            await asyncio.gather(self._prewarm, return_exceptions=True)
        if self.dns is not None:
            await self.dns.stop()
        if self.sds_server is not None:
            await self.sds_server.stop()
        if self.secret_manager is not None:
            await self.secret_manager.stop()
        log.info("agent stopped")

    async def __aenter__(self) -> Agent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _metrics_merger(settings: StatusSettings, bootstrap: BootstrapSettings | None) -> MetricsMerger:
    """The merged-metrics handler (built on the first scrape)."""
    from istio_agent.status.metrics import MetricsMerger

    envoy_port = None
    if bootstrap is not None and settings.merge_envoy_stats:
        envoy_port = bootstrap.envoy_prometheus_port
    return MetricsMerger(REGISTRY, envoy_port=envoy_port, app=settings.prometheus)


def _app_probes(settings: StatusSettings) -> AppProbes:
    """The app-probe handler (built on the first probe)."""
    from istio_agent.status.probes import AppProbes

    return AppProbes(
        settings.app_probers,
        pod_ip=settings.pod_ip,
        status_port=settings.port,
        keepalive=settings.probe_keepalive,
        http2=settings.http2_probing,
    )


def _log_name_table(table: nds_pb2.NameTable) -> None:
    log.info("DNS name table updated: %d hosts", len(table.table))
