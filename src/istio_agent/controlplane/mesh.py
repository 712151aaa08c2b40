"""The local control plane's mesh file: a small YAML document describing the mesh.

The whole document is validated up front into frozen dataclasses (``services``, ``workloads``,
``nameTable``), so the xDS generators can trust what they get and a typo in the file is a clear
error naming the entry, never a silently ignored key or a half-built snapshot. ``raw`` keeps the
document as loaded.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import yaml

from istio_agent.config.document import Keys, Node, kind
from istio_agent.controlplane.wasmplugins import WasmPlugin, read_pull_secrets, read_wasm_plugins

DEFAULT_TRUST_DOMAIN = "cluster.local"
DEFAULT_DOMAIN_SUFFIX = "cluster.local"
DEFAULT_NAMESPACE = "default"
DEFAULT_SERVICE_ACCOUNT = "default"
DEFAULT_WORKLOAD_ADDRESS = "127.0.0.1"
PROTOCOLS = ("http", "grpc", "tcp")
HTTP_PROTOCOLS = ("http", "grpc")
"""Protocols served through the HTTP connection manager (gRPC is HTTP/2)."""

# SPIFFE trust domain names: lower-case letters, digits, '.', '-' and '_'.
_TRUST_DOMAIN = re.compile(r"^[a-z0-9._-]{1,255}$")
# Kubernetes DNS-1123 label (service and namespace names) and subdomain (pod and account names).
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_SUBDOMAIN = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# A DNS name as a name-table key: optional leading "*." wildcard, optional trailing dot.
_HOST = re.compile(
    r"^(?=.{1,254}$)(\*\.)?[A-Za-z0-9_]([-A-Za-z0-9_]{0,61}[A-Za-z0-9_])?"
    r"(\.[A-Za-z0-9_]([-A-Za-z0-9_]{0,61}[A-Za-z0-9_])?)*\.?$"
)

_TOP_KEYS = (
    "trustDomain",
    "domainSuffix",
    "services",
    "workloads",
    "nameTable",
    "pullSecrets",
    "wasmPlugins",
)
_SERVICE_KEYS = ("name", "namespace", "port", "protocol", "addresses")
_WORKLOAD_KEYS = (
    "name",
    "namespace",
    "serviceAccount",
    "address",
    "labels",
    "services",
    "inboundPort",
    "appPort",
    "outbound",
    "proxyless",
    "capture",
)
_OUTBOUND_KEYS = ("service", "port")
_NAME_ENTRY_KEYS = ("ips", "registry", "shortname", "namespace", "altHosts")


class MeshError(Exception):
    """The mesh file cannot be used; the message names the file and the problem."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"mesh file {path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class Service:
    """A mesh service: ``<name>.<namespace>.svc.<domain_suffix>`` on one port."""

    name: str
    namespace: str
    port: int
    protocol: str = "http"
    addresses: tuple[str, ...] = ()
    domain_suffix: str = DEFAULT_DOMAIN_SUFFIX

    @property
    def hostname(self) -> str:
        return f"{self.name}.{self.namespace}.svc.{self.domain_suffix}"

    @property
    def ref(self) -> str:
        """The canonical ``name.namespace`` reference workloads use."""
        return f"{self.name}.{self.namespace}"

    @property
    def is_http(self) -> bool:
        """Whether traffic to it goes through the HTTP connection manager (http and grpc)."""
        return self.protocol in HTTP_PROTOCOLS


@dataclass(frozen=True)
class OutboundBinding:
    """A loopback listener (no iptables): the workload's Envoy listens on 127.0.0.1:<port> for ``service``.

    ``service`` is the canonical ``name.namespace`` reference.
    """

    service: str
    port: int


@dataclass(frozen=True)
class Workload:
    """One proxy (pod or VM) and what it serves and calls; ``services`` are canonical ``name.namespace``."""

    name: str
    namespace: str = DEFAULT_NAMESPACE
    service_account: str = DEFAULT_SERVICE_ACCOUNT
    address: str = DEFAULT_WORKLOAD_ADDRESS
    labels: dict[str, str] = field(default_factory=dict)
    services: tuple[str, ...] = ()
    inbound_port: int | None = None
    app_port: int | None = None
    outbound: tuple[OutboundBinding, ...] = ()
    proxyless: bool = False
    """A proxyless gRPC workload: no Envoy; its xDS gRPC server listens on ``appPort`` itself."""
    capture: bool = False
    """Its traffic is captured by iptables (istio-iptables or istio-cni in its pod): its Envoy gets
    istiod's outbound capture listener on 15001 and a listener per service port, not loopback bindings."""

    @property
    def endpoint_port(self) -> int | None:
        """Where callers reach it: its Envoy's ``inboundPort``, or a proxyless server's ``appPort``."""
        return self.app_port if self.proxyless else self.inbound_port

    def spiffe_id(self, trust_domain: str) -> str:
        return f"spiffe://{trust_domain}/ns/{self.namespace}/sa/{self.service_account}"


@dataclass(frozen=True)
class NameEntry:
    """One NDS name-table entry as written in ``nameTable`` (Istio's NameTable.NameInfo)."""

    ips: tuple[str, ...] = ()
    registry: str = ""
    shortname: str = ""
    namespace: str = ""
    alt_hosts: tuple[str, ...] = ()


@dataclass(frozen=True)
class MeshConfig:
    """The parsed mesh file; ``raw`` is the whole document as loaded (do not mutate it)."""

    trust_domain: str = DEFAULT_TRUST_DOMAIN
    raw: dict[str, Any] = field(default_factory=dict)
    domain_suffix: str = DEFAULT_DOMAIN_SUFFIX
    services: tuple[Service, ...] = ()
    workloads: tuple[Workload, ...] = ()
    name_table: dict[str, NameEntry] = field(default_factory=dict)
    wasm_plugins: tuple[WasmPlugin, ...] = ()
    """WasmPlugins, in file order (:mod:`istio_agent.controlplane.wasmplugins`)."""
    pull_secrets: dict[str, bytes] = field(default_factory=dict)
    """Image pull secrets by ``kubernetes://<ns>/<name>``: docker config JSON."""

    def service(self, ref: str, default_namespace: str) -> Service | None:
        """The service ``ref`` names: ``name`` (in ``default_namespace``) or ``name.namespace``."""
        name, namespace = split_ref(ref, default_namespace)
        for service in self.services:
            if service.name == name and service.namespace == namespace:
                return service
        return None

    def workload(self, name: str, namespace: str) -> Workload | None:
        for workload in self.workloads:
            if workload.name == name and workload.namespace == namespace:
                return workload
        return None

    def backing_workloads(self, service: Service) -> tuple[Workload, ...]:
        """The workloads that list ``service`` among the services they back, in file order."""
        return tuple(w for w in self.workloads if service.ref in w.services)


def split_ref(ref: str, default_namespace: str) -> tuple[str, str]:
    """``"name"`` or ``"name.namespace"`` as (name, namespace)."""
    name, dot, namespace = ref.partition(".")
    return (name, namespace) if dot else (name, default_namespace)


def load_mesh(path: Path) -> MeshConfig:
    """Read and validate the mesh file at ``path``; MeshError when it is missing or invalid."""
    return parse_mesh(read_mesh_bytes(path), path)


def read_mesh_bytes(path: Path) -> bytes:
    """The raw mesh file; MeshError when it cannot be read."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise MeshError(path, "file does not exist") from None
    except OSError as err:
        raise MeshError(path, f"cannot read: {err.strerror or err}") from None


def parse_mesh(data: bytes | str, path: Path) -> MeshConfig:
    """Parse mesh-file content; ``path`` only names the source in errors.

    An empty file is an error rather than "all defaults": an editor truncating the file before
    writing it must not flip a running control plane to the default trust domain. Write ``{}``.
    """
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as err:
        raise MeshError(path, f"not UTF-8 text (byte {err.start})") from None
    if not text.strip():
        raise MeshError(path, "file is empty (write {} for an all-defaults mesh)")
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise MeshError(path, f"invalid YAML{where}: {problem}") from None
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise MeshError(path, f"the document must be a mapping, not {type(document).__name__}")
    return _MeshReader(path).read(document)


# -- validation ------------------------------------------------------------------------------------


def _ip(value: str) -> str | None:
    """The canonical text of an IPv4/IPv6 address, None when ``value`` is not one."""
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        return None


class _Fields:
    """One mapping of the mesh file; every problem is reported under its ``where`` prefix."""

    def __init__(self, path: Path, where: str, value: object, known: tuple[str, ...]) -> None:
        self.path = path
        self.node = Node(value, where, self._error)
        self.fields = self.node.fields(known, Keys.EXACT)
        self.value: dict[Any, Any] = self.node.value

    @property
    def where(self) -> str:
        return self.node.where

    def rename(self, where: str) -> None:
        """Name the entry by what it is (``services[0] (b.default)``) once that is known."""
        self.node = Node(self.node.value, where, self._error)
        self.fields = self.node.fields(tuple(self.fields.given()), Keys.EXACT)

    def _error(self, where: str, problem: str) -> MeshError:
        return MeshError(self.path, f"{where}: {problem}" if where else problem)

    def fail(self, reason: str) -> NoReturn:
        self.node.fail(reason)

    def string(self, key: str, default: str | None = None) -> str:
        node = self.fields[key]
        if node.is_null and default is None:
            self.fail(f'missing required key "{key}"')
        return node.string(default or "")

    def name(self, key: str, pattern: re.Pattern[str], what: str, default: str | None = None) -> str:
        value = self.string(key, default)
        if not pattern.match(value):
            self.fail(f"{key} {value!r} is not a valid {what}")
        return value

    def port(self, key: str) -> int:
        if self.fields[key].is_null:
            self.fail(f'missing required key "{key}"')
        return self.fields[key].port()

    def optional_port(self, key: str) -> int | None:
        node = self.fields[key]
        return None if node.is_null else node.port()

    def items(self, key: str) -> list[Node]:
        return self.fields[key].items()

    def strings(self, key: str) -> tuple[str, ...]:
        return self.fields[key].strings()

    def ips(self, key: str) -> tuple[str, ...]:
        result = []
        for index, item in enumerate(self.strings(key)):
            address = _ip(item)
            if address is None:
                self.fail(f'{key}[{index}] "{item}" is not an IP address')
            result.append(address)
        return tuple(result)


class _MeshReader:
    """Turns the loaded YAML document into a MeshConfig, or raises the first MeshError."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self, document: dict[Any, Any]) -> MeshConfig:
        top = _Fields(self.path, "", document, _TOP_KEYS)
        trust_domain = document.get("trustDomain", DEFAULT_TRUST_DOMAIN)
        if not isinstance(trust_domain, str) or not _TRUST_DOMAIN.match(trust_domain):
            top.fail(
                f"trustDomain {trust_domain!r} is not a valid trust domain "
                "(use lower-case letters, digits, '.', '-' and '_')"
            )
        domain_suffix = top.string("domainSuffix", DEFAULT_DOMAIN_SUFFIX)
        if not _SUBDOMAIN.match(domain_suffix):
            top.fail(f"domainSuffix {domain_suffix!r} is not a valid DNS domain")
        services = self._services(top.items("services"), domain_suffix)
        partial = MeshConfig(trust_domain=trust_domain, domain_suffix=domain_suffix, services=services)
        workloads = self._workloads(top.items("workloads"), partial)
        pull_secrets = read_pull_secrets(top.fields["pullSecrets"], self.path.parent)
        return MeshConfig(
            trust_domain=trust_domain,
            raw=document,
            domain_suffix=domain_suffix,
            services=services,
            workloads=workloads,
            name_table=self._name_table(top.fields["nameTable"]),
            wasm_plugins=read_wasm_plugins(top.fields["wasmPlugins"], pull_secrets),
            pull_secrets=pull_secrets,
        )

    def _services(self, items: list[Node], domain_suffix: str) -> tuple[Service, ...]:
        services: list[Service] = []
        seen: dict[str, int] = {}
        for index, item in enumerate(items):
            entry = _Fields(self.path, item.where, item.value, _SERVICE_KEYS)
            name = entry.name("name", _LABEL, "DNS-1123 label")
            namespace = entry.name("namespace", _LABEL, "namespace (DNS-1123 label)", DEFAULT_NAMESPACE)
            entry.rename(f"services[{index}] ({name}.{namespace})")
            port = entry.port("port")
            protocol = entry.string("protocol", "http").lower()
            if protocol not in PROTOCOLS:
                entry.fail(f"protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
            service = Service(name, namespace, port, protocol, entry.ips("addresses"), domain_suffix)
            if service.hostname in seen:
                entry.fail(f"duplicate service {service.hostname} (also services[{seen[service.hostname]}])")
            seen[service.hostname] = index
            services.append(service)
        return tuple(services)

    def _workloads(self, items: list[Node], mesh: MeshConfig) -> tuple[Workload, ...]:
        workloads: list[Workload] = []
        seen: dict[str, int] = {}
        for index, item in enumerate(items):
            workload = self._workload(index, item, mesh)
            key = f"{workload.name}.{workload.namespace}"
            if key in seen:
                raise MeshError(
                    self.path, f"workloads[{index}] ({key}): duplicate workload (also workloads[{seen[key]}])"
                )
            seen[key] = index
            workloads.append(workload)
        return tuple(workloads)

    def _workload(self, index: int, item: Node, mesh: MeshConfig) -> Workload:
        entry = _Fields(self.path, item.where, item.value, _WORKLOAD_KEYS)
        name = entry.name("name", _SUBDOMAIN, "workload name (DNS-1123 subdomain)")
        namespace = entry.name("namespace", _LABEL, "namespace (DNS-1123 label)", DEFAULT_NAMESPACE)
        entry.rename(f"workloads[{index}] ({name}.{namespace})")
        account = entry.name(
            "serviceAccount", _SUBDOMAIN, "service account (DNS-1123 subdomain)", DEFAULT_SERVICE_ACCOUNT
        )
        raw_address = entry.string("address", DEFAULT_WORKLOAD_ADDRESS)
        address = _ip(raw_address)
        if address is None:
            entry.fail(f'address "{raw_address}" is not an IP address')
        labels = self._labels(entry)
        backed: list[str] = []
        for ref_index, ref in enumerate(entry.strings("services")):
            service = mesh.service(ref, namespace)
            if service is None:
                entry.fail(
                    f'services[{ref_index}] refers to unknown service "{".".join(split_ref(ref, namespace))}"'
                )
            if service.ref in backed:
                entry.fail(f'services[{ref_index}] lists "{service.ref}" again')
            backed.append(service.ref)
        inbound_port = entry.optional_port("inboundPort")
        app_port = entry.optional_port("appPort")
        proxyless = not entry.fields["proxyless"].is_null and entry.fields["proxyless"].boolean()
        if proxyless:
            self._check_proxyless(entry, mesh, backed, inbound_port, app_port)
        elif backed and inbound_port is None:
            entry.fail("backs services but has no inboundPort (where its Envoy accepts mesh traffic)")
        if backed and app_port is None:
            entry.fail("backs services but has no appPort (where its application listens)")
        if inbound_port is not None and inbound_port == app_port:
            entry.fail(f"inboundPort and appPort are both {inbound_port}")
        outbound = self._outbound(entry, mesh, namespace, inbound_port, app_port)
        capture = not entry.fields["capture"].is_null and entry.fields["capture"].boolean()
        if capture and proxyless:
            entry.fail("captures traffic (capture: true) but is proxyless: there is no Envoy to capture to")
        if capture and outbound:
            entry.fail(
                "captures traffic (capture: true) and has outbound bindings: "
                "a captured workload reaches services by name or address"
            )
        return Workload(
            name=name,
            namespace=namespace,
            service_account=account,
            address=address,
            labels=labels,
            services=tuple(backed),
            inbound_port=inbound_port,
            app_port=app_port,
            outbound=outbound,
            proxyless=proxyless,
            capture=capture,
        )

    @staticmethod
    def _check_proxyless(
        entry: _Fields, mesh: MeshConfig, backed: list[str], inbound_port: int | None, app_port: int | None
    ) -> None:
        """A proxyless workload has no Envoy: no inboundPort, no outbound bindings, gRPC services only."""
        if inbound_port is not None:
            entry.fail("is proxyless (no Envoy) but has an inboundPort: its gRPC server listens on appPort")
        if entry.items("outbound"):
            entry.fail(
                "is proxyless but has outbound bindings: a proxyless client dials xds:///<host>:<port>"
            )
        if backed and app_port is None:
            entry.fail("backs services but has no appPort (where its xDS gRPC server listens)")
        for ref in backed:
            service = mesh.service(ref, "")
            if service is not None and service.protocol != "grpc":
                entry.fail(f'is proxyless but backs "{ref}", whose protocol is {service.protocol}, not grpc')

    @staticmethod
    def _labels(entry: _Fields) -> dict[str, str]:
        node = entry.fields["labels"]
        if node.is_null:
            return {}
        labels = node.map()
        for key, label in labels.items():
            if not isinstance(key, str):
                node.fail(f"key {key!r}: expected a string, got {kind(key)}")
            if not isinstance(label, str):
                node.child(key, label).fail(f"expected a string, got {kind(label)} (quote it)")
        return dict(sorted(labels.items()))

    def _outbound(
        self,
        entry: _Fields,
        mesh: MeshConfig,
        namespace: str,
        inbound_port: int | None,
        app_port: int | None,
    ) -> tuple[OutboundBinding, ...]:
        bindings: list[OutboundBinding] = []
        ports: dict[int, int] = {}
        for index, item in enumerate(entry.items("outbound")):
            where = f"outbound[{index}]"
            binding = _Fields(self.path, item.where, item.value, _OUTBOUND_KEYS)
            ref = binding.string("service")
            service = mesh.service(ref, namespace)
            if service is None:
                entry.fail(f'{where} refers to unknown service "{".".join(split_ref(ref, namespace))}"')
            port = binding.port("port")
            if port in ports:
                entry.fail(f"{where} port {port} is already used by outbound[{ports[port]}]")
            if port == inbound_port:
                entry.fail(f"{where} port {port} is the workload's inboundPort")
            if port == app_port:
                entry.fail(f"{where} port {port} is the workload's appPort")
            ports[port] = index
            bindings.append(OutboundBinding(service.ref, port))
        return tuple(bindings)

    def _name_table(self, node: Node) -> dict[str, NameEntry]:
        if node.is_null:
            return {}
        value = node.map()
        table: dict[str, NameEntry] = {}
        for host in sorted(value, key=str):
            if not isinstance(host, str) or not _HOST.match(host):
                raise MeshError(self.path, f"nameTable key {host!r} is not a valid host name")
            entry = _Fields(self.path, f'nameTable["{host}"]', value[host], _NAME_ENTRY_KEYS)
            table[host] = NameEntry(
                ips=entry.ips("ips"),
                registry=entry.string("registry", ""),
                shortname=entry.string("shortname", ""),
                namespace=entry.string("namespace", ""),
                alt_hosts=tuple(entry.strings("altHosts")),
            )
        return table
