"""The Agent: builds the subsystems from settings, runs them, and stops them in reverse order.

Start order follows Istio's agent (pilot/cmd/pilot-agent, pkg/istio-agent/agent.go): the status
server (readiness answers from the start), the DNS proxy, secrets and the SDS server, the xDS proxy
on ``./etc/istio/proxy/XDS`` and the proxyless gRPC bootstrap next to it, then Envoy on a generated
bootstrap, then VM health checks. One difference, for a faster start: the SDS and xDS sockets are
bound and listening before Envoy starts (everything Envoy needs is listening when it starts, as in
Istio), but the servers behind them, the secret manager and the CA client are loaded and started
right after Envoy, while Envoy's connections wait in the sockets' queues (``envoy.sockets``).
Stopping is the exact reverse of Istio's order, after readiness fails and the status port stops
accepting; Envoy's drain is its step.

Nothing heavy is imported with this module (grpc, protos, certificates): what Envoy does not need
to start is imported after it started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from istio_agent.bootstrap.envoy import write_bootstrap
from istio_agent.config import ConfigError, ProxyConfig, SecuritySettings, XdsSettings
from istio_agent.config.bootstrap import BootstrapSettings
from istio_agent.config.dns import DnsSettings
from istio_agent.config.grpc import GrpcBootstrapSettings
from istio_agent.config.security import CERT_CHAIN_FILE, CRL_PATH, KEY_FILE, ROOT_CERT_FILE
from istio_agent.config.status import StatusSettings
from istio_agent.envoy.process import EnvoyProcess
from istio_agent.envoy.supervisor import EnvoySupervisor
from istio_agent.istiod.tokens import TokenSource, token_source_for
from istio_agent.log import report_failure, scope
from istio_agent.metrics import Registry

if TYPE_CHECKING:  # imported when used: not needed to start Envoy
    from istio_agent.config.probes import ReadinessProbeConfig
    from istio_agent.dns.proxy import DnsProxy
    from istio_agent.envoy.sockets import Listener
    from istio_agent.probe.kubelet import AppProbes
    from istio_agent.protos import nds_pb2
    from istio_agent.security.manager import CAClient, SecretManager
    from istio_agent.security.sds import SdsServer
    from istio_agent.status.metrics import MetricsMerger
    from istio_agent.status.readiness import Readiness
    from istio_agent.status.server import StatusServer
    from istio_agent.xds.handlers import NameTableHandler
    from istio_agent.xds.proxy import XdsProxy
    from istio_agent.xds.tap import DebugTap
    from istio_agent.xds.upstream import UpstreamDialer

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
    grpc_bootstrap: GrpcBootstrapSettings | None = None  # written once the xDS proxy listens


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
    from istio_agent.uds import remove_if_stale

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


CAClientFactory = Callable[[SecuritySettings], "CAClient"]
"""Builds the CA client for the certificate settings (tests swap in a fake CA)."""
DialerFactory = Callable[[XdsSettings, TokenSource | None], "UpstreamDialer"]
"""Builds the xDS proxy's upstream dialer (tests swap in one that dials a fake istiod)."""


class Agent:
    """One workload's agent. ``start()`` brings everything up; ``stop()`` tears it down.

    Each subsystem is registered on an exit stack as it starts, so stopping runs the exact reverse
    of starting, every step runs even when an earlier one fails (the failure is logged), and a start
    that fails half-way stops what had already started.
    """

    def __init__(
        self,
        settings: AgentSettings,
        *,
        ca_client: CAClientFactory | None = None,
        dialer: DialerFactory | None = None,
        registry: Registry,
    ) -> None:
        """``ca_client``: Istio's CA client by default; ``dialer``: the xDS proxy's UpstreamDialer by default."""
        self._settings = settings
        self._ca_client = ca_client
        self._dialer = dialer
        self._registry = registry
        self.secret_manager: SecretManager | None = None
        self.sds_server: SdsServer | None = None
        self.xds_proxy: XdsProxy | None = None
        self.debug_tap: DebugTap | None = None
        self.name_table: NameTableHandler | None = None
        self.dns: DnsProxy | None = None
        self.envoy: EnvoySupervisor | None = None
        self.readiness: Readiness | None = None
        self.status_server: StatusServer | None = None
        self.stop_requested = asyncio.Event()
        """Set by ``/quitquitquit``: whoever runs the agent should stop it."""
        self._started_at = time.monotonic()
        self._skip_drain = False
        self._stack: AsyncExitStack | None = None

    async def start(self) -> None:
        """Start every subsystem in Istio's order; on failure, stop those already started and raise."""
        if self._stack is not None:
            raise RuntimeError("agent already started")
        stack = AsyncExitStack()
        try:
            await self._start(stack)
        except BaseException:
            self._skip_drain = True  # an Envoy already started never served: nothing to drain
            await stack.aclose()
            raise
        self._stack = stack

    async def _start(self, stack: AsyncExitStack) -> None:
        settings = self._settings
        if settings.status is not None and settings.status.enabled:
            # First, as Istio's agent: /healthz/ready answers (not ready, and why) from the start.
            sock = self._bind_status_port(stack, settings.status)
            if sock is not None:
                await self._start_status_server(stack, settings.status, sock)
        if settings.dns is not None and settings.dns.enabled:
            await self._start_dns(stack, settings.dns)  # as Istio: before anything that may need names
        output = settings.security.output_certs
        if output is not None:
            from istio_agent.security.output import check_writable

            try:
                await asyncio.to_thread(check_writable, output)
            except OSError as err:
                raise ConfigError(f"OUTPUT_CERTS {output} is not writable: {_os_error(err)}") from None
        plan = await plan_sds(settings.security)
        # Envoy's sockets listen before Envoy starts; the servers behind them start right after it.
        # They are stopped after Envoy, as when they started before it.
        servers = AsyncExitStack()
        stack.push_async_callback(servers.aclose)
        sds_socket, xds_socket = await self._listen(servers, plan)
        if settings.bootstrap is not None:
            await self._start_envoy(stack, settings.bootstrap)
        await self._start_servers(servers, plan, sds_socket, xds_socket)
        if settings.grpc_bootstrap is not None:
            await _write_grpc_bootstrap(settings.grpc_bootstrap)
        if settings.health is not None and self.xds_proxy is not None:
            self._start_health_checks(stack, settings.health, self.xds_proxy)

    async def _listen(self, stack: AsyncExitStack, plan: SdsPlan) -> tuple[Listener | None, Listener | None]:
        """The SDS and xDS sockets, listening (each closed on unwind unless its server took it over)."""
        from istio_agent.envoy import sockets

        sds = xds = None
        if self._settings.serve_sds:
            sds = await sockets.listen_sds(plan.socket_path)
            _on_unwind(stack, "SDS socket", sds.close)
        if self._settings.xds is not None:
            xds = await sockets.listen_xds(self._settings.xds)
            _on_unwind(stack, "xDS socket", xds.close)
        return sds, xds

    async def _start_servers(
        self, stack: AsyncExitStack, plan: SdsPlan, sds_socket: Listener | None, xds_socket: Listener | None
    ) -> None:
        """Secrets, the SDS server and the xDS proxy (with the debug tap), on the listening sockets."""
        from istio_agent.security.manager import SecretManager

        ca_client = self._ca_client_factory()(plan.settings) if plan.uses_ca else None
        manager = SecretManager(plan.settings, ca_client, registry=self._registry)
        await _started(stack, "secret manager", manager.start, manager.stop)
        self.secret_manager = manager
        if sds_socket is not None:
            from istio_agent.security.sds import SdsServer

            crl = Path(CRL_PATH) if plan.settings.enable_ca_crl else None
            sds = SdsServer(
                manager, plan.socket_path, crl_path=crl, registry=self._registry, listener=sds_socket
            )
            manager.add_update_callback(sds.on_secret_update)
            await _started(stack, "SDS server", sds.start, sds.stop)
            self.sds_server = sds
        if plan.uses_ca:
            _background(stack, "certificate prewarm", manager.prewarm())
        if self._settings.xds is not None:
            tokens = token_source_for(plan.settings)
            await self._start_xds_proxy(stack, self._settings.xds, manager, tokens, xds_socket)

    def _ca_client_factory(self) -> CAClientFactory:
        if self._ca_client is not None:
            return self._ca_client
        from istio_agent.security.caclient import CitadelClient

        return functools.partial(CitadelClient.from_settings, registry=self._registry)

    async def stop(self, cause: str = "received termination signal") -> None:
        """Fail readiness, close the status port, then stop everything in reverse order (Envoy drains)."""
        if self.readiness is not None:
            self.readiness.terminate(cause)  # readiness fails at once
        if self.status_server is not None:
            await self.status_server.close_listener()  # as Istio: 15020 refuses during the drain
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()
        log.info("agent stopped")

    async def __aenter__(self) -> Agent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def wait_envoy(self) -> int:
        """Wait for Envoy to exit for good (after any restarts) and return its exit status.

        Waits forever when the agent runs no Envoy.
        """
        if self.envoy is None:
            await asyncio.Event().wait()
        assert self.envoy is not None
        return await self.envoy.wait()

    # -- the subsystems ---------------------------------------------------------------------------
    async def _start_dns(self, stack: AsyncExitStack, settings: DnsSettings) -> None:
        """The DNS proxy on DNS_PROXY_ADDR; a bind or resolv.conf error fails the start (DnsStartError)."""
        from istio_agent.dns.proxy import DnsProxy

        dns = DnsProxy(settings, workdir=self._settings.workdir, registry=self._registry)
        await _started(stack, "DNS proxy", dns.start, dns.stop)
        self.dns = dns

    async def _start_xds_proxy(
        self,
        stack: AsyncExitStack,
        settings: XdsSettings,
        manager: SecretManager,
        tokens: TokenSource | None,
        listener: Listener | None,
    ) -> None:
        from istio_agent.xds.handlers import NameTableHandler, ProxyConfigHandler
        from istio_agent.xds.proxy import XdsProxy
        from istio_agent.xds.relay import TypeHandler
        from istio_agent.xds.upstream import UpstreamDialer

        handlers: list[TypeHandler] = []
        if settings.nds_enabled:
            self.name_table = NameTableHandler(_log_name_table)
            if self.dns is not None:
                self.name_table.add_listener(self.dns.update)
            handlers.append(self.name_table)
        if settings.pcds_enabled:
            handlers.append(ProxyConfigHandler(manager.update_trust_bundle))
        dialer = (self._dialer or UpstreamDialer)(settings, tokens)
        proxy = XdsProxy(
            settings, handlers=handlers, dialer=dialer, registry=self._registry, listener=listener
        )
        await _started(stack, "xDS proxy", proxy.start, proxy.stop)
        self.xds_proxy = proxy
        if settings.debug_tap_port is not None:
            await self._start_debug_tap(stack, proxy, settings.debug_tap_port)
        log.info("xDS proxy on %s, upstream %s", settings.socket_path, settings.discovery_address)

    async def _start_debug_tap(self, stack: AsyncExitStack, proxy: XdsProxy, port: int) -> None:
        """The debug tap on localhost; a port in use is logged and the agent runs on without it."""
        from istio_agent.xds.tap import DebugTap, TapStartError

        tap = DebugTap(proxy, port)
        try:
            await _started(stack, "debug tap", tap.start, tap.stop)
        except TapStartError as err:
            log.error("%s; continuing without the debug tap", err)
            return
        self.debug_tap = tap

    async def _start_envoy(self, stack: AsyncExitStack, settings: BootstrapSettings) -> None:
        """Start Envoy (raises EnvoyStartError when it cannot be executed); ENVOY_RESTART_ON_EXIT restarts it.

        Stopping drains it (unless ``/quitquitquit`` or ``/drain`` said not to wait), which also ends a
        restart backoff.
        """
        custom = self._settings.proxy_config.custom_config_file
        if custom:
            log.info("starting Envoy with the custom config file %s", settings.workdir / custom)

        async def launch() -> EnvoyProcess:
            if custom:
                return EnvoyProcess(settings, settings.workdir / custom, owns_bootstrap=False)
            return EnvoyProcess(settings, await asyncio.to_thread(write_bootstrap, settings))

        envoy = EnvoySupervisor(launch, restart=settings.restart_on_exit, registry=self._registry)

        async def drain_and_stop() -> None:
            await envoy.drain_and_stop(graceful_drain=not self._skip_drain)

        await _started(stack, "Envoy", envoy.start, drain_and_stop)
        self.envoy = envoy

    def _bind_status_port(self, stack: AsyncExitStack, settings: StatusSettings) -> socket.socket | None:
        """The status port, listening; a bind failure is only logged (the agent runs on without it)."""
        from istio_agent.http.listen import listening_socket

        try:
            sock = listening_socket(settings.host, settings.port)
        except OSError as err:
            log.error("status server %s; continuing without the status server", err)
            return None
        stack.callback(sock.close)  # a no-op once the server has closed it
        return sock

    def _secrets_view(self) -> dict[str, Any] | None:
        """``/debug/secrets``; its module is imported on the first request, off the start-up path."""
        if self.secret_manager is None:
            return None
        from istio_agent.security.debug import secrets_view

        return secrets_view(self.secret_manager)

    async def _start_status_server(
        self, stack: AsyncExitStack, settings: StatusSettings, sock: socket.socket
    ) -> None:
        """Serve the status port: readiness at once, metrics and app probes built on first use.

        Started before the subsystems it reports on: readiness asks for them when it is asked.
        """
        from istio_agent.envoy.readiness import EnvoyReadiness
        from istio_agent.status.lazy import LazyHandler
        from istio_agent.status.readiness import DnsReadiness, GrpcBootstrapReadiness, Prober, Readiness
        from istio_agent.status.server import StatusServer

        bootstrap = self._settings.bootstrap
        probers: list[Prober] = []
        if bootstrap is not None:
            probers.append(
                EnvoyReadiness(
                    bootstrap.localhost,
                    bootstrap.proxy_admin_port,
                    started_at=self._started_at,
                    registry=self._registry,
                )
            )
        if self._settings.grpc_bootstrap is not None:
            probers.append(GrpcBootstrapReadiness(self._settings.grpc_bootstrap.path))
        dns_settings, xds_settings = self._settings.dns, self._settings.xds
        if dns_settings is not None and dns_settings.enabled:
            # Ready once a table from this run answers (a big one is built aside).
            probers.append(DnsReadiness(lambda: self.dns is not None and self.dns.ready))
        elif xds_settings is not None and xds_settings.nds_enabled:
            probers.append(DnsReadiness(lambda: self.name_table is not None and self.name_table.ready))
        readiness = Readiness(probers)
        self.readiness = readiness
        registry = self._registry
        metrics = LazyHandler(lambda: _metrics_merger(settings, bootstrap, registry))
        probes = LazyHandler(lambda: _app_probes(settings)) if settings.app_probers else None
        server = StatusServer(
            settings.host,
            settings.port,
            readiness,
            metrics=metrics,
            app_probes=probes,
            ndsz=lambda: self.dns.ndsz() if self.dns is not None else None,
            secrets=self._secrets_view,
            on_quit=self._quit,
            on_drain=self._drain,
            metrics_localhost_only=settings.metrics_localhost_only,
            registry=registry,
        )

        async def stop() -> None:
            await server.stop()
            for handler in (metrics, probes):
                if handler is not None:
                    await handler.close()

        try:
            await _started(stack, "status server", lambda: server.start(sock), stop)
        except OSError as err:
            log.error("%s; continuing without the status server", err)
            return
        self.status_server = server

    def _start_health_checks(
        self, stack: AsyncExitStack, config: ReadinessProbeConfig, proxy: XdsProxy
    ) -> None:
        """VM health checks (WorkloadGroup readinessProbe); transitions are reported to istiod over xDS."""
        from istio_agent.envoy.readiness import EnvoyReadiness
        from istio_agent.health.checker import HealthChecker
        from istio_agent.probe.workload import build_probers

        bootstrap = self._settings.bootstrap
        envoy = None
        host = self._settings.status.pod_ip if self._settings.status else "localhost"
        if bootstrap is not None:
            envoy = EnvoyReadiness(
                bootstrap.localhost,
                bootstrap.proxy_admin_port,
                started_at=self._started_at,
                registry=self._registry,
            )
            host = bootstrap.ips[0] if bootstrap.ips else "localhost"
        probers = build_probers(config, default_host=host, envoy=envoy)
        checker = HealthChecker(config, probers, proxy.report_health, registry=self._registry)
        _background(stack, "health checks", checker.run())
        stack.callback(checker.stop)  # unwound first: the loop ends on its own before the task is cancelled
        log.info("workload health checks started (every %gs)", config.period)

    # -- status port callbacks ------------------------------------------------------------------------
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


async def _started(
    stack: AsyncExitStack,
    name: str,
    start: Callable[[], Awaitable[object]],
    stop: Callable[[], Awaitable[object]],
) -> None:
    """Run ``start``; once it succeeded, register ``stop`` to run when the stack unwinds."""
    await start()
    _on_unwind(stack, name, stop)


def _on_unwind(stack: AsyncExitStack, name: str, stop: Callable[[], Awaitable[object]]) -> None:
    """Run ``stop`` when the stack unwinds; a failure is logged and the other steps still run."""

    async def stop_step() -> None:
        try:
            await stop()
        except Exception:  # one step failing must not keep the others from running
            log.exception("stopping the %s failed", name)

    stack.push_async_callback(stop_step)


async def _write_grpc_bootstrap(settings: GrpcBootstrapSettings) -> None:
    """Write the proxyless gRPC bootstrap; a failure stops the start, as in Istio."""
    from istio_agent.bootstrap.grpc import write_grpc_bootstrap

    try:
        path = await asyncio.to_thread(write_grpc_bootstrap, settings)
    except OSError as err:
        raise ConfigError(f"failed generating gRPC XDS bootstrap {settings.path}: {_os_error(err)}") from None
    log.info("gRPC xDS bootstrap written to %s", path)


def _os_error(err: OSError) -> str:
    """``<path>: <reason>`` for the file the system refused (a parent directory, a temporary file)."""
    reason = err.strerror or str(err)
    return f"{err.filename}: {reason}" if err.filename else reason


def _background(stack: AsyncExitStack, name: str, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """Run ``coroutine`` as a task that the stack cancels (and waits for) when it unwinds."""
    task = asyncio.get_running_loop().create_task(coroutine, name=name)
    task.add_done_callback(report_failure(log, name))  # when it happens, not when the agent stops

    async def cancel() -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    stack.push_async_callback(cancel)
    return task


def _metrics_merger(
    settings: StatusSettings, bootstrap: BootstrapSettings | None, registry: Registry
) -> MetricsMerger:
    """The merged-metrics handler (built on the first scrape)."""
    from istio_agent.status.metrics import MetricsMerger

    envoy_port = None
    if bootstrap is not None and settings.merge_envoy_stats:
        envoy_port = bootstrap.envoy_prometheus_port
    return MetricsMerger(registry, envoy_port=envoy_port, app=settings.prometheus)


def _app_probes(settings: StatusSettings) -> AppProbes:
    """The app-probe handler (built on the first probe)."""
    from istio_agent.probe.kubelet import AppProbes

    return AppProbes(
        settings.app_probers,
        pod_ip=settings.pod_ip,
        status_port=settings.port,
        keepalive=settings.probe_keepalive,
        http2=settings.http2_probing,
    )


def _log_name_table(table: nds_pb2.NameTable) -> None:
    log.info("DNS name table updated: %d hosts", len(table.table))
