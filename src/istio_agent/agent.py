"""The Agent: builds the subsystems from settings, runs them, and stops them in reverse order.

Start order follows Istio's agent: secrets and the SDS server, then the xDS proxy on
``./etc/istio/proxy/XDS``, then Envoy on a generated bootstrap (so everything Envoy needs is
listening before it starts). Stop order is the reverse, with Envoy drained first.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from istio_agent.bootstrap.envoy import write_bootstrap
from istio_agent.config import ConfigError, ProxyConfig, SecuritySettings, XdsSettings
from istio_agent.config.bootstrap import BootstrapSettings
from istio_agent.config.security import CERT_CHAIN_FILE, CRL_PATH, KEY_FILE, ROOT_CERT_FILE
from istio_agent.envoy.process import EnvoyProcess
from istio_agent.log import scope
from istio_agent.protos import nds_pb2
from istio_agent.security.caclient import CAClientOptions, CitadelClient
from istio_agent.security.credentials import token_source_for
from istio_agent.security.manager import SecretManager
from istio_agent.security.sds import SdsServer
from istio_agent.security.uds import remove_if_stale
from istio_agent.xds.handlers import NameTableHandler, ProxyConfigHandler
from istio_agent.xds.proxy import TypeHandler, XdsProxy

log = scope("agent")


@dataclass(frozen=True)
class AgentSettings:
    """What to run. ``xds=None`` runs no xDS proxy and ``bootstrap=None`` no Envoy (certificates only)."""

    security: SecuritySettings
    proxy_config: ProxyConfig = field(default_factory=ProxyConfig)
    xds: XdsSettings | None = None
    bootstrap: BootstrapSettings | None = None
    serve_sds: bool = True  # Istio's DISABLE_ENVOY (proxyless) runs no SDS server


@dataclass(frozen=True)
class SdsPlan:
    """Where the SDS server listens and where certificates come from (reference sds.md §1.2)."""

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
        self.envoy: EnvoyProcess | None = None
        self._prewarm: asyncio.Task[None] | None = None

    async def start(self) -> None:
        plan = await plan_sds(self._settings.security)
        ca_client = None
        if plan.uses_ca:
            options = CAClientOptions.from_settings(plan.settings)
            ca_client = CitadelClient(options, token_source_for(plan.settings))
            log.info("CA client for %s (%s)", options.address, "plaintext" if options.plaintext else "TLS")
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
        if self._settings.bootstrap is not None:
            await self._start_envoy(self._settings.bootstrap)

    async def _start_xds_proxy(self, settings: XdsSettings, manager: SecretManager) -> None:
        handlers: list[TypeHandler] = []
        if settings.nds_enabled:
            self.name_table = NameTableHandler(_log_name_table)
            handlers.append(self.name_table)
        if settings.pcds_enabled:
            handlers.append(ProxyConfigHandler(manager.update_trust_bundle))
        self.xds_proxy = XdsProxy(settings, handlers=handlers)
        await self.xds_proxy.start()
        log.info("xDS proxy on %s, upstream %s", settings.socket_path, settings.discovery_address)

    async def _start_envoy(self, settings: BootstrapSettings) -> None:
        custom = self._settings.proxy_config.custom_config_file
        if custom:
            path = settings.workdir / custom
            log.info("starting Envoy with the custom config file %s", path)
            self.envoy = EnvoyProcess(settings, path, owns_bootstrap=False)
        else:
            path = await asyncio.to_thread(write_bootstrap, settings)
            self.envoy = EnvoyProcess(settings, path)
        await self.envoy.start()

    async def wait_envoy(self) -> int:
        """Wait for Envoy to exit on its own and return its exit code; waits forever without Envoy."""
        if self.envoy is None:
            await asyncio.Event().wait()
        assert self.envoy is not None
        return await self.envoy.wait()

    async def stop(self) -> None:
        if self.envoy is not None and self.envoy.returncode is None:
            await self.envoy.drain_and_stop()
        if self.xds_proxy is not None:
            await self.xds_proxy.stop()
        if self._prewarm is not None:
            self._prewarm.cancel()
            await asyncio.gather(self._prewarm, return_exceptions=True)
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


def _log_name_table(table: nds_pb2.NameTable) -> None:
    log.info("DNS name table updated: %d hosts", len(table.table))
