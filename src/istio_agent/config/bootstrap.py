"""Settings for Envoy's bootstrap and process, resolved once from Istio's flags, env and pod files.

``BootstrapSettings`` is everything the bootstrap builder (``istio_agent.bootstrap.envoy``) and the
Envoy supervisor (``istio_agent.envoy.process``) need: node identity and metadata, ports, log levels,
drain timings and absolute paths under the agent's working directory. Both consumers are then pure
or nearly so, and a bad value is reported here, at start-up, naming the variable.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from istio_agent import ISTIO_VERSION
from istio_agent.config import node
from istio_agent.config.document import DocumentSyntaxError, load_document
from istio_agent.config.env import ConfigError, Env, out_of_range
from istio_agent.config.proxy_config import (
    MAX_CONCURRENCY,
    MAX_CONNECTION_LIMIT,
    MAX_DRAIN_DURATION,
    ProxyConfig,
    resolve_udp_address,
)
from istio_agent.config.security import SecuritySettings
from istio_agent.log import scope

log = scope("bootstrap")

PROXY_TYPES = ("sidecar", "router", "waypoint", "ztunnel", "agentgateway")
ENVOY_LOG_LEVELS = ("trace", "debug", "info", "warning", "warn", "error", "critical", "off")
POD_LABELS_FILE = "etc/istio/pod/labels"
POD_ANNOTATIONS_FILE = "etc/istio/pod/annotations"
BOOTSTRAP_FILE = "envoy-rev.json"
LIGHTSTEP_TOKEN_FILE = "lightstep_access_token.txt"
PROFILE_PATH = "var/lib/istio/data/envoy.prof"
EXCLUDE_INTERFACES_ANNOTATION = "traffic.sidecar.istio.io/excludeInterfaces"
DEFAULT_MAX_DOWNSTREAM_CONNECTIONS = 2147483647


class HostFacts(Protocol):
    """What only the machine can tell; the caller asks it (``istio_agent.host.LocalHost``), config never does."""

    def interface_addresses(self) -> list[tuple[str, str]]:
        """(interface, IP) of the usable addresses of the interfaces that are up."""
        ...

    def resolve(self, host: str, port: int) -> str:
        """The first address ``host`` resolves to for UDP; OSError when it does not."""
        ...


@dataclass(frozen=True)
class BootstrapSettings:
    """What the Envoy bootstrap and command line are made of (Istio: pkg/bootstrap/config.go, pkg/envoy/proxy.go)."""

    workdir: Path
    proxy_type: str = "sidecar"
    ips: tuple[str, ...] = ("127.0.0.1", "::1")
    pod_name: str = ""
    pod_namespace: str = ""
    service_account: str = ""
    domain: str = ".svc.cluster.local"
    node_id: str = ""
    service_cluster: str = "istio-proxy"
    metadata: dict[str, Any] = field(default_factory=dict)
    locality: dict[str, str] = field(default_factory=dict)
    proxy_admin_port: int = 15000
    status_port: int = 15020
    envoy_status_port: int = 15021
    envoy_prometheus_port: int = 15090
    listener_host: str = "0.0.0.0"
    prometheus_host: str = "0.0.0.0"
    delta_xds: bool = True
    drain_duration: timedelta = timedelta(seconds=45)
    termination_drain_duration: timedelta = timedelta(seconds=5)
    exit_on_zero_active_connections: bool = False
    minimum_drain_duration: timedelta = timedelta(seconds=5)
    restart_on_exit: bool = False  # beyond Istio (VMs): ENVOY_RESTART_ON_EXIT restarts a crashed Envoy
    file_flush_interval: timedelta = timedelta(seconds=1)
    file_flush_min_size_kb: int = 0
    log_level: str = "warning"
    component_log_level: str = ""
    concurrency: int = 0
    log_as_json: bool = False
    config_path: Path = Path("etc/istio/proxy")
    sds_socket_path: Path = Path("var/run/secrets/workload-spiffe-uds/socket")
    binary: Path = Path("/usr/local/bin/envoy")
    skip_deprecated_logs: bool = True
    enable_core_dump: bool = False
    config_yaml: str = ""
    strip_fragment_from_path: bool = True
    max_downstream_connections: int = DEFAULT_MAX_DOWNSTREAM_CONNECTIONS
    proxy_config: ProxyConfig = field(default_factory=ProxyConfig)
    host_ip: str = ""
    outlier_log_path: str = ""
    statsd_address: str = ""  # statsdUdpAddress resolved to IP:port at start-up

    # -- derived -----------------------------------------------------------------------------------
    @property
    def ipv6_only(self) -> bool:
        """Istio's "IPv6" mode: every node IP is IPv6 (Envoy then talks to the agent over ::1)."""
        return all(ipaddress.ip_address(ip).version == 6 for ip in self.ips)

    @property
    def drain_budget(self) -> timedelta:
        """The longest Envoy's drain may take once the agent stops: terminationDrainDuration, or with
        EXIT_ON_ZERO_ACTIVE_CONNECTIONS the drainDuration that bounds the wait for zero connections."""
        if self.exit_on_zero_active_connections:
            return self.drain_duration
        return self.termination_drain_duration

    @property
    def localhost(self) -> str:
        return "::1" if self.ipv6_only else "127.0.0.1"

    @property
    def xds_socket_path(self) -> Path:
        return self.config_path / "XDS"

    @property
    def bootstrap_path(self) -> Path:
        return self.config_path / BOOTSTRAP_FILE

    @property
    def lightstep_token_path(self) -> Path:
        return self.config_path / LIGHTSTEP_TOKEN_FILE

    @property
    def profile_path(self) -> Path:
        return self.workdir / PROFILE_PATH

    @property
    def admin_url(self) -> str:
        host = f"[{self.localhost}]" if ":" in self.localhost else self.localhost
        return f"http://{host}:{self.proxy_admin_port}"

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_env(
        cls,
        env: Env,
        *,
        workdir: Path,
        proxy_config: ProxyConfig,
        security: SecuritySettings,
        host: HostFacts,
        proxy_type: str = "sidecar",
        domain: str = "",
        log_level: str = "warning",
        component_log_level: str = "",
        concurrency: int = 0,
        log_as_json: bool = False,
        listener_host: str = "",
        outlier_log_path: str = "",
    ) -> BootstrapSettings:
        """Resolve the settings; raise ConfigError naming the flag, variable or file on a bad value.

        ``listener_host`` overrides the wildcard address of the 15021/15090 listeners (tests and demos
        running several proxies on one host bind 127.0.0.1).
        """
        if proxy_type not in PROXY_TYPES:
            raise ConfigError(f"invalid proxy Type: {proxy_type}")
        pod_name, namespace = env.text("POD_NAME"), env.text("POD_NAMESPACE")
        annotations = _read_pod_info(workdir / POD_ANNOTATIONS_FILE)
        pod_labels = _read_pod_info(workdir / POD_LABELS_FILE)
        excluded = {
            name.strip()
            for name in (annotations or {}).get(EXCLUDE_INTERFACES_ANNOTATION, "").split(",")
            if name.strip()
        }
        ips = node_ips(env.text("INSTANCE_IP"), host.interface_addresses(), excluded)
        domain = domain or f"{namespace}.svc.cluster.local"
        status_port = env.integer("ENVOY_STATUS_PORT", 15021, minimum=1, maximum=65535)
        prometheus_port = env.integer("ENVOY_PROMETHEUS_PORT", 15090, minimum=1, maximum=65535)
        exit_on_zero = env.flag("EXIT_ON_ZERO_ACTIVE_CONNECTIONS")
        minimum_drain = env.duration(
            "MINIMUM_DRAIN_DURATION", timedelta(seconds=5), minimum=timedelta(0), maximum=MAX_DRAIN_DURATION
        )
        skip_deprecated_logs = env.flag("ENVOY_SKIP_DEPRECATED_LOGS", True)
        problem = out_of_range(concurrency, 0, MAX_CONCURRENCY)
        if problem is not None:
            raise ConfigError(f"invalid value for --concurrency={concurrency}: {problem}")
        if concurrency == 0 and proxy_config.concurrency is not None:
            concurrency = proxy_config.concurrency
        elif concurrency == 0:
            concurrency = env.integer("ISTIO_CPU_LIMIT", 0, minimum=0, maximum=MAX_CONCURRENCY)
        level, components = split_log_level(log_level, component_log_level)

        metadata = node.build_metadata(
            node.MetadataSources(
                proxy_metadata=proxy_config.proxy_metadata,
                meta_env=env.with_prefix("ISTIO_META_"),
                meta_json=_meta_json(env),
                dns_proxy_addr=env.text("DNS_PROXY_ADDR"),
                istio_version=ISTIO_VERSION,
                instance_ips=ips,
                envoy_status_port=status_port,
                envoy_prometheus_port=prometheus_port,
                pod_name=pod_name,
                namespace=namespace,
                service_account=env.text("SERVICE_ACCOUNT"),
                cluster_id=security.cluster_id,
                pod_labels=pod_labels,
                pod_annotations=annotations,
                pilot_san=(
                    [node.pilot_san(proxy_config.discovery_address)]
                    if proxy_config.control_plane_auth_policy == "MUTUAL_TLS"
                    else None
                ),
                workload_identity_socket_file=security.workload_identity_socket_file,
                proxy_config=node.proxy_config_json(proxy_config),
                exit_on_zero_active_connections=exit_on_zero,
                skip_deprecated_logs=skip_deprecated_logs,
                outlier_log_path=outlier_log_path,
            )
        )
        labels = metadata.get("LABELS") or {}
        ipv6_only = all(ipaddress.ip_address(ip).version == 6 for ip in ips)
        localhost = "::1" if ipv6_only else "127.0.0.1"
        wildcard = listener_host or ("::" if ipv6_only else "0.0.0.0")
        metrics_local_only = proxy_config.proxy_metadata.get("METRICS_LOCALHOST_ACCESS_ONLY", "") == "true"
        config_path = (workdir / proxy_config.config_path).absolute()
        host_ip = env.text("HOST_IP")
        return cls(
            workdir=workdir,
            proxy_type=proxy_type,
            ips=ips,
            pod_name=pod_name,
            pod_namespace=namespace,
            service_account=env.text("SERVICE_ACCOUNT"),
            domain=domain,
            node_id=node.service_node(proxy_type, ips, pod_name, namespace, domain),
            service_cluster=node.service_cluster(
                proxy_config.service_cluster, labels, str(metadata.get("WORKLOAD_NAME", "")), namespace
            ),
            metadata=metadata,
            locality=node.locality(labels.get(node.LOCALITY_LABEL, "")),
            proxy_admin_port=proxy_config.proxy_admin_port,
            status_port=proxy_config.status_port,
            envoy_status_port=status_port,
            envoy_prometheus_port=prometheus_port,
            listener_host=wildcard,
            prometheus_host=localhost if metrics_local_only else wildcard,
            delta_xds=env.flag("ISTIO_DELTA_XDS", True),
            drain_duration=proxy_config.drain_duration,
            termination_drain_duration=proxy_config.termination_drain_duration,
            exit_on_zero_active_connections=exit_on_zero,
            minimum_drain_duration=minimum_drain,
            restart_on_exit=env.flag("ENVOY_RESTART_ON_EXIT"),
            log_level=level,
            component_log_level=components,
            concurrency=concurrency,
            log_as_json=log_as_json,
            config_path=config_path,
            sds_socket_path=security.sds_socket_path,
            binary=Path(proxy_config.binary_path),
            skip_deprecated_logs=skip_deprecated_logs,
            enable_core_dump=env.flag("ISTIO_ENVOY_ENABLE_CORE_DUMP"),
            config_yaml=_bootstrap_override(env.text("ISTIO_BOOTSTRAP_OVERRIDE"), workdir, host_ip),
            strip_fragment_from_path=env.flag("HTTP_STRIP_FRAGMENT_FROM_PATH_UNSAFE_IF_DISABLED", True),
            max_downstream_connections=_max_connections(proxy_config),
            proxy_config=proxy_config,
            host_ip=host_ip,
            outlier_log_path=outlier_log_path,
            statsd_address=resolve_udp_address(proxy_config.statsd_udp_address, host_ip, host.resolve),
        )


# -- log levels -------------------------------------------------------------------------------------
def split_log_level(proxy_log_level: str, proxy_component_log_level: str = "") -> tuple[str, str]:
    """``--proxyLogLevel`` (+ deprecated ``--proxyComponentLogLevel``) -> Envoy ``-l`` and component levels.

    Items without ``:`` set the level (last wins); ``comp:level`` items are component levels, which
    win over ``--proxyComponentLogLevel``; items with more colons are dropped with a warning.
    """
    level = ""
    components: list[str] = []
    for item in proxy_log_level.split(","):
        parts = item.split(":")
        if len(parts) == 1:
            level = item
        elif len(parts) == 2:
            components.append(item)
        else:
            log.warning("dropping invalid log level: %s", item)
    if level:
        _check_level(level, "--proxyLogLevel")
    for item in components:
        _check_level(item.split(":")[1], "--proxyLogLevel")
    if components:
        return level, ",".join(components)
    for item in filter(None, proxy_component_log_level.split(",")):
        parts = item.split(":")
        if len(parts) != 2:
            raise ConfigError(f"invalid value for --proxyComponentLogLevel: {item!r} is not component:level")
        _check_level(parts[1], "--proxyComponentLogLevel")
    return level, proxy_component_log_level


def _check_level(level: str, flag: str) -> None:
    if level not in ENVOY_LOG_LEVELS:
        raise ConfigError(f"invalid value for {flag}: unknown Envoy log level {level!r}")


# -- node IPs ---------------------------------------------------------------------------------------
def node_ips(
    instance_ip: str, interfaces: Iterable[tuple[str, str]], excluded_interfaces: set[str]
) -> tuple[str, ...]:
    """INSTANCE_IP first (when it parses), then interface IPs; 127.0.0.1 and ::1 when none were found."""
    ips: list[str] = []
    if instance_ip:
        try:
            ips.append(str(ipaddress.ip_address(instance_ip)))
        except ValueError:
            log.warning("ignoring INSTANCE_IP=%r: not an IP address", instance_ip)
    found = [ip for name, ip in interfaces if name not in excluded_interfaces]
    for ip in found:
        if ip not in ips:
            ips.append(ip)
    if not found:
        ips.extend(ip for ip in ("127.0.0.1", "::1") if ip not in ips)
    return tuple(ips)


# -- small parsers ----------------------------------------------------------------------------------
def _meta_json(env: Env) -> dict[str, dict[str, Any]]:
    """ISTIO_METAJSON_<KEY> values: each must be a JSON object (LABELS: of strings)."""
    parsed: dict[str, dict[str, Any]] = {}
    for key, raw in env.with_prefix("ISTIO_METAJSON_").items():
        name = f"ISTIO_METAJSON_{key}"
        try:
            value = json.loads(raw)
        except ValueError as err:
            raise ConfigError(f"invalid value for {name}: not valid JSON: {err}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"invalid value for {name}: expected a JSON object")
        if key == "LABELS" and not all(isinstance(v, str) for v in value.values()):
            raise ConfigError(f"invalid value for {name}: label values must be strings")
        if key:
            parsed[key] = value
    return parsed


def read_pod_annotations(workdir: Path) -> dict[str, str]:
    """The pod's annotations from the downward-API file (empty when absent); ConfigError when malformed."""
    return _read_pod_info(workdir / POD_ANNOTATIONS_FILE) or {}


def _read_pod_info(path: Path) -> dict[str, str] | None:
    """A downward-API file (``key="value"`` lines); None when absent."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror}") from None
    try:
        return node.parse_downward_api(text)
    except ValueError as err:
        raise ConfigError(f"invalid pod info file {path}: {err}") from None


def _max_connections(proxy_config: ProxyConfig) -> int:
    """Envoy's global downstream connection limit, first set of: connectionSettings, proxyMetadata, runtimeValues."""
    if proxy_config.global_downstream_connection_limit:
        return proxy_config.global_downstream_connection_limit
    for source, values, key in (
        ("proxyMetadata", proxy_config.proxy_metadata, "ISTIO_META_GLOBAL_DOWNSTREAM_MAX_CONNECTIONS"),
        ("runtimeValues", proxy_config.runtime_values, "overload.global_downstream_max_connections"),
    ):
        raw = values.get(key, "")
        if raw:
            name = f"{source} {key}"
            return Env({name: raw}).integer(name, 0, minimum=1, maximum=MAX_CONNECTION_LIMIT)
    return DEFAULT_MAX_DOWNSTREAM_CONNECTIONS


def _bootstrap_override(path: str, workdir: Path, host_ip: str) -> str:
    """ISTIO_BOOTSTRAP_OVERRIDE as JSON for ``--config-yaml``; problems are warnings, as in Istio."""
    if not path:
        return ""
    file = Path(path) if Path(path).is_absolute() else workdir / path
    try:
        text = file.read_text()
    except OSError as err:
        log.warning("failed to read bootstrap override %s: %s", file, err.strerror)
        return ""
    try:
        doc = load_document(text)
    except DocumentSyntaxError as err:
        log.warning("failed to convert bootstrap override %s to JSON: %s", file, err)
        return ""
    if not isinstance(doc, dict):
        log.warning("ignoring bootstrap override %s: not a map", file)
        return ""
    converted = json.dumps(doc, separators=(",", ":"))
    if host_ip:  # substituted after the YAML parse, so a bracketed IPv6 address cannot break it
        converted = converted.replace("$(HOST_IP)", f"[{host_ip}]" if ":" in host_ip else host_ip)
    return converted
