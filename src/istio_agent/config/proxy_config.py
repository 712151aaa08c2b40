"""ProxyConfig: the subset of Istio's ``meshconfig.ProxyConfig`` the agent uses.

Sources, in increasing precedence (as Istio): defaults, the mesh config file's ``defaultConfig``,
``PROXY_CONFIG`` (YAML or JSON), the pod annotation ``proxy.istio.io/config``. Overlays replace
fields (lists and nested messages replaced whole), except ``proxyMetadata``, whose maps merge.
Every field is type-checked on overlay, so a typo fails start-up with the field's name instead of
surfacing later as an Envoy that refuses its bootstrap.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from istio_agent import goformat
from istio_agent.config.document import DocumentSyntaxError, Keys, Node, config_errors, load_document
from istio_agent.config.env import INT32_MAX, ConfigError, Env
from istio_agent.log import scope

log = scope("config")

DEFAULT_DISCOVERY_ADDRESS = "istiod.istio-system.svc:15012"
PROXY_CONFIG_ANNOTATION = "proxy.istio.io/config"
INTERCEPTION_MODES = ("REDIRECT", "TPROXY", "NONE")
SUPPORTED_TRACERS = ("zipkin", "lightstep", "datadog")
IGNORED_TRACERS = ("stackdriver", "openCensusAgent")
_STAT_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
MAX_DRAIN_DURATION = timedelta(hours=24)
"""Beyond Istio (no bound): a drain longer than a day is a typo, and it bounds how long SIGTERM may take."""
MAX_CONCURRENCY = 1024
"""Beyond Istio (no bound): Envoy starts a worker thread per unit of concurrency."""
MAX_CONNECTION_LIMIT = INT32_MAX
"""Envoy's global downstream connection limit; the default (2147483647) already means "no limit"."""


@dataclass(frozen=True)
class StatsMatcher:
    """``proxyStatsMatcher``: extra Envoy stats to keep (Istio adds its required ones)."""

    inclusion_prefixes: tuple[str, ...] = ()
    inclusion_suffixes: tuple[str, ...] = ()
    inclusion_regexps: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        doc = {
            "inclusionPrefixes": list(self.inclusion_prefixes),
            "inclusionRegexps": list(self.inclusion_regexps),
            "inclusionSuffixes": list(self.inclusion_suffixes),
        }
        return {key: value for key, value in doc.items() if value}


@dataclass(frozen=True)
class Tracing:
    """``tracing``: the tracer Envoy reports spans to, plus settings istiod reads (sampling, tags).

    Only one tracer is set (a oneof in Istio's API). ``raw`` keeps the document for node metadata.
    """

    tracer: str = ""
    address: str = ""
    access_token: str = field(default="", repr=False)
    sampling: float | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

    def to_json(self) -> dict[str, Any]:
        """The document as given, without the Lightstep access token (a secret istiod never needs)."""
        doc = {key: value for key, value in self.raw.items()}
        lightstep = doc.get("lightstep")
        if isinstance(lightstep, dict) and "accessToken" in lightstep:
            doc["lightstep"] = {k: v for k, v in lightstep.items() if k != "accessToken"}
        return doc


@dataclass(frozen=True)
class ProxyConfig:
    discovery_address: str = DEFAULT_DISCOVERY_ADDRESS
    config_path: str = "./etc/istio/proxy"
    binary_path: str = "/usr/local/bin/envoy"
    custom_config_file: str = ""
    service_cluster: str = "istio-proxy"
    proxy_admin_port: int = 15000
    status_port: int = 15020
    control_plane_auth_policy: str = "MUTUAL_TLS"
    proxy_metadata: dict[str, str] = field(default_factory=dict)
    drain_duration: timedelta = timedelta(seconds=45)
    termination_drain_duration: timedelta = timedelta(seconds=5)
    concurrency: int | None = None
    extra_stat_tags: tuple[str, ...] = ()
    proxy_stats_matcher: StatsMatcher | None = None
    tracing: Tracing | None = None
    statsd_udp_address: str = ""
    runtime_values: dict[str, str] = field(default_factory=dict)
    readiness_probe: dict[str, Any] | None = None
    mesh_id: str = ""
    hold_application_until_proxy_starts: bool | None = None
    interception_mode: str = ""
    global_downstream_connection_limit: int | None = None

    _FIELDS = {
        "discoveryAddress": "discovery_address",
        "configPath": "config_path",
        "binaryPath": "binary_path",
        "customConfigFile": "custom_config_file",
        "serviceCluster": "service_cluster",
        "proxyAdminPort": "proxy_admin_port",
        "statusPort": "status_port",
        "controlPlaneAuthPolicy": "control_plane_auth_policy",
        "proxyMetadata": "proxy_metadata",
        "drainDuration": "drain_duration",
        "terminationDrainDuration": "termination_drain_duration",
        "concurrency": "concurrency",
        "extraStatTags": "extra_stat_tags",
        "proxyStatsMatcher": "proxy_stats_matcher",
        "tracing": "tracing",
        "statsdUdpAddress": "statsd_udp_address",
        "runtimeValues": "runtime_values",
        "readinessProbe": "readiness_probe",
        "meshId": "mesh_id",
        "holdApplicationUntilProxyStarts": "hold_application_until_proxy_starts",
        "interceptionMode": "interception_mode",
        "connectionSettings": "global_downstream_connection_limit",
    }

    def overlay(self, doc: dict[str, Any], source: str) -> ProxyConfig:
        """Apply a ProxyConfig document (camelCase keys).

        Unknown keys, and keys other components own (``gatewayTopology``), are ignored as in Istio's
        lenient parse.
        """
        changes: dict[str, Any] = {}
        fields = Node(doc, "", config_errors(f"{source}: ")).fields(
            tuple(self._FIELDS), Keys.PROTOJSON_LENIENT
        )
        for key in fields.given():
            name, node = self._FIELDS[key], fields[key]
            if name == "proxy_metadata":
                changes[name] = {**self.proxy_metadata, **node.string_map()}
            elif node.is_null:  # an explicit null resets the field, as protobuf JSON does
                changes[name] = _FIELD_DEFAULTS[name]
            else:
                changes[name] = _PARSERS[name](node)
        updated = dataclasses.replace(self, **changes)
        updated.validate(source)
        return updated

    def validate(self, source: str = "ProxyConfig") -> None:
        """Checks that span more than a number's range (each field's range is checked as it is read)."""
        if not _is_host_port(self.discovery_address):
            raise ConfigError(f"{source}: discoveryAddress {self.discovery_address!r} must be host:port")
        if self.control_plane_auth_policy not in ("NONE", "MUTUAL_TLS"):
            raise ConfigError(f"{source}: controlPlaneAuthPolicy must be NONE or MUTUAL_TLS")
        if self.statsd_udp_address and not _is_host_port(self.statsd_udp_address):
            raise ConfigError(f"{source}: statsdUdpAddress {self.statsd_udp_address!r} must be host:port")
        if self.tracing is not None and self.tracing.address and not _is_host_port(self.tracing.address):
            raise ConfigError(
                f"{source}: tracing.{self.tracing.tracer}.address {self.tracing.address!r} must be host:port"
            )

    def to_json(self) -> dict[str, Any]:
        """Protobuf JSON (camelCase, ``45s`` durations, empty values omitted, keys sorted).

        This is node metadata ``PROXY_CONFIG``; the Lightstep token is left out.
        """
        doc: dict[str, Any] = {}
        for json_name, attr in self._FIELDS.items():
            value = getattr(self, attr)
            if isinstance(value, timedelta):
                doc[json_name] = duration_json(value)
            elif isinstance(value, StatsMatcher | Tracing):
                doc[json_name] = value.to_json()
            elif attr == "global_downstream_connection_limit":
                if value is not None:
                    doc[json_name] = {"globalDownstreamConnectionLimit": value}
            elif isinstance(value, bool) or (attr == "concurrency" and value is not None):
                doc[json_name] = value  # wrapper types: present (even 0/false) once set
            elif isinstance(value, tuple):
                if value:
                    doc[json_name] = list(value)
            elif value:  # protobuf JSON leaves out empty strings, zero numbers and empty maps
                doc[json_name] = dict(value) if isinstance(value, dict) else value
        return {key: doc[key] for key in sorted(doc)}

    @classmethod
    def load(
        cls,
        env: Env,
        mesh_config_file: Path | None = None,
        pod_annotations: Mapping[str, str] | None = None,
    ) -> ProxyConfig:
        config = cls()
        if mesh_config_file is not None and mesh_config_file.exists():
            mesh = _parse_document(mesh_config_file.read_text(), str(mesh_config_file))
            default_config = mesh.get("defaultConfig") or {}
            if not isinstance(default_config, dict):
                raise ConfigError(f"{mesh_config_file}: defaultConfig must be a map")
            config = config.overlay(default_config, str(mesh_config_file))
        raw = env.text("PROXY_CONFIG")
        if raw.strip():
            config = config.overlay(_parse_document(raw, "PROXY_CONFIG"), "PROXY_CONFIG")
        annotation = (pod_annotations or {}).get(PROXY_CONFIG_ANNOTATION, "")
        if annotation.strip():
            source = f"annotation {PROXY_CONFIG_ANNOTATION}"
            config = config.overlay(_parse_document(annotation, source), source)
        return config


def duration_json(value: timedelta) -> str:
    """A protobuf JSON Duration: seconds with 0, 3, 6 or 9 fractional digits (``5s``, ``1.500s``)."""
    micros = round(value.total_seconds() * 1_000_000)
    seconds, fraction = divmod(abs(micros), 1_000_000)
    sign = "-" if micros < 0 else ""
    if not fraction:
        return f"{sign}{seconds}s"
    if fraction % 1000 == 0:
        return f"{sign}{seconds}.{fraction // 1000:03d}s"
    return f"{sign}{seconds}.{fraction:06d}s"


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError when malformed."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{address!r}: an IPv6 address needs brackets, e.g. [::1]:9411")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} must be host:port")
    return host, int(port)


def substitute_host_ip(address: str, host_ip: str) -> str:
    """Replace ``$(HOST_IP)`` (Istio's convention for node-local agents), bracketing an IPv6 address."""
    if "$(HOST_IP)" not in address:
        return address
    return address.replace("$(HOST_IP)", f"[{host_ip}]" if ":" in host_ip else host_ip)


def resolve_udp_address(address: str, host_ip: str, resolve: Callable[[str, int], str]) -> str:
    """``statsdUdpAddress`` as ``IP:port`` (Envoy's statsd sink takes no names); "" with a warning on failure.

    Runs once at start-up, as Istio resolves it while building the ProxyConfig.
    """
    if not address:
        return ""
    try:
        host, port = split_host_port(substitute_host_ip(address, host_ip))
        ip = resolve(host, port)
    except (ValueError, OSError) as err:
        log.warning("ignoring statsdUdpAddress %r: cannot resolve it: %s", address, err)
        return ""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


# -- field parsers ----------------------------------------------------------------------------------
def _is_host_port(address: str) -> bool:
    try:
        split_host_port(address)
    except ValueError:
        return False
    return True


def _string(node: Node) -> str:
    return node.text()


def _port(node: Node) -> int:
    """A port as Istio validates it (1-65535); an integer or a numeric string (protojson)."""
    return node.port(lenient=True)


def _status_port(node: Node) -> int:
    """As a port, but 0 is allowed too: it turns the status server off."""
    return node.integer(minimum=0, maximum=65535, lenient=True)


def _concurrency(node: Node) -> int:
    return node.integer(minimum=0, maximum=MAX_CONCURRENCY, lenient=True)


def _bool(node: Node) -> bool:
    return node.boolean()


def _drain_duration(node: Node) -> timedelta:
    """Envoy's ``--drain-time-s`` takes whole seconds."""
    duration = node.duration(minimum=timedelta(seconds=1), maximum=MAX_DRAIN_DURATION)
    if duration.total_seconds() % 1:
        node.fail(f"must be whole seconds, got {goformat.duration(duration)}")
    return duration


def _termination_drain_duration(node: Node) -> timedelta:
    return node.duration(minimum=timedelta(0), maximum=MAX_DRAIN_DURATION)


def _string_map(node: Node) -> dict[str, str]:
    return node.string_map()


def _stat_tags(node: Node) -> tuple[str, ...]:
    tags = node.strings()
    for tag in tags:
        if tag and not _STAT_TAG.match(tag):
            node.fail(f"{tag!r} is not a valid stat tag name (letters, digits, _ . -)")
    return tags


def _stats_matcher(node: Node) -> StatsMatcher:
    fields = node.fields(_STATS_MATCHER_FIELDS, Keys.PROTOJSON_LENIENT)
    prefixes, suffixes, regexps = (fields[name].strings() for name in _STATS_MATCHER_FIELDS)
    for pattern in regexps:
        try:
            re.compile(pattern)
        except re.error as err:
            fields["inclusionRegexps"].fail(f"{pattern!r} is not a valid regex: {err}")
    return StatsMatcher(prefixes, suffixes, regexps)


def _tracing(node: Node) -> Tracing:
    fields = node.fields(_TRACING_FIELDS, Keys.PROTOJSON_LENIENT)
    tracers = [name for name in (*SUPPORTED_TRACERS, *IGNORED_TRACERS) if name in fields.set()]
    if len(tracers) > 1:
        node.fail(f"only one tracer may be set, got {', '.join(tracers)}")
    sampling: float | None = None
    if not fields["sampling"].is_null:
        sampling = fields["sampling"].number(minimum=0, maximum=100)  # a percentage
    for name in ("customTags", "tlsSettings"):
        if not fields[name].is_null:
            fields[name].map()  # what is in it is istiod's business
    doc: dict[str, Any] = node.value
    if not tracers:
        return Tracing(sampling=sampling, raw=doc)
    tracer = tracers[0]
    if tracer in IGNORED_TRACERS:
        log.warning("%s is not supported by this agent; Envoy gets no tracer", fields[tracer].where)
        return Tracing(sampling=sampling, raw=doc)
    settings = fields[tracer].fields(("address", "accessToken"), Keys.PROTOJSON_LENIENT)
    address = settings["address"].string()
    if not address:
        settings["address"].fail("must be set")
    token = settings["accessToken"].string() if tracer == "lightstep" else ""
    return Tracing(tracer=tracer, address=address, access_token=token, sampling=sampling, raw=doc)


def _interception_mode(node: Node) -> str:
    return node.choice(INTERCEPTION_MODES)


def _connection_limit(node: Node) -> int | None:
    limit = node.fields(("globalDownstreamConnectionLimit",), Keys.PROTOJSON_LENIENT)[
        "globalDownstreamConnectionLimit"
    ]
    return None if limit.is_null else limit.integer(minimum=0, maximum=MAX_CONNECTION_LIMIT, lenient=True)


def _readiness_probe(node: Node) -> dict[str, Any]:
    """Kept as the camelCase document; ``istio_agent.config.probes`` interprets it."""
    return dict(node.map())


_STATS_MATCHER_FIELDS = ("inclusionPrefixes", "inclusionSuffixes", "inclusionRegexps")
_TRACING_FIELDS = (*SUPPORTED_TRACERS, *IGNORED_TRACERS, "sampling", "customTags", "tlsSettings")
_PARSERS: dict[str, Callable[[Node], Any]] = {
    "discovery_address": _string,
    "config_path": _string,
    "binary_path": _string,
    "custom_config_file": _string,
    "service_cluster": _string,
    "proxy_admin_port": _port,
    "status_port": _status_port,
    "control_plane_auth_policy": _string,
    "drain_duration": _drain_duration,
    "termination_drain_duration": _termination_drain_duration,
    "concurrency": _concurrency,
    "extra_stat_tags": _stat_tags,
    "proxy_stats_matcher": _stats_matcher,
    "tracing": _tracing,
    "statsd_udp_address": _string,
    "runtime_values": _string_map,
    "readiness_probe": _readiness_probe,
    "mesh_id": _string,
    "hold_application_until_proxy_starts": _bool,
    "interception_mode": _interception_mode,
    "global_downstream_connection_limit": _connection_limit,
}
_FIELD_DEFAULTS: dict[str, Any] = {
    f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
    for f in dataclasses.fields(ProxyConfig)
}


def _parse_document(text: str, source: str) -> dict[str, Any]:
    try:
        doc = load_document(text)
    except DocumentSyntaxError as err:
        raise ConfigError(f"{source}: not valid YAML/JSON: {err}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: expected a map, got {type(doc).__name__}")
    return doc
