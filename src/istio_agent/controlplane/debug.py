"""The local control plane's answers to istiod's debug types (``istio.io/debug/*``).

istiod answers these on any ADS stream (``pilot/pkg/xds/statusgen.go``): ``syncz`` lists every
connected proxy with where each type it watches stands, and ``config_dump`` is what istiod
generated for one proxy. The agent's debug tap and ``agentctl proxy-status`` read them. Both are
built here from the stream core's own bookkeeping (:class:`~istio_agent.xds.watch.Watch`): nothing
is tracked twice.

As istiod 1.28: a NACKed type is ``ERROR`` with the NACK's text in ``error_state`` until the
proxy ACKs again; only proxies are listed (a node with ``PROXY_CONFIG`` metadata, or a ztunnel), not
debug clients or proxyless gRPC apps; and who may ask is :class:`DebugAccess`
(``ENABLE_DEBUG_ENDPOINT_AUTH``): an asker without a verified identity (the plaintext port) is
refused, and one whose identity is outside the system namespace sees only its own namespace's
proxies. Beyond istiod, a debug type this control plane does not serve gets a clear error on a
stream that asked only debug questions (istiod ignores types it has no generator for; on a proxy's
own stream, which the agent's tap uses, so do we, so the proxy's configuration keeps flowing).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from envoy.admin.v3 import config_dump_shared_pb2 as dump_pb2
from envoy.service.status.v3 import csds_pb2
from google.protobuf import any_pb2, timestamp_pb2
from google.protobuf.message import Message

from istio_agent.config.env import parse_go_bool
from istio_agent.controlplane.xdsgen import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    EXTENSION_CONFIG_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    ProxyNode,
)
from istio_agent.xds.flavour import Resource
from istio_agent.xds.watch import Watch

DEBUG_PREFIX = "istio.io/debug"
SYNCZ_TYPE = DEBUG_PREFIX + "/syncz"
CONFIG_DUMP_TYPE = DEBUG_PREFIX + "/config_dump"
SERVED = (SYNCZ_TYPE, CONFIG_DUMP_TYPE)
SYNCZ_METADATA = ("CLUSTER_ID", "NAMESPACE", "ISTIO_VERSION")
"""The node metadata istiod copies into each syncz entry."""
SYSTEM_NAMESPACE = "istio-system"
AUTHENTICATION_REQUIRED = "authentication required"
"""istiod's answer (Unauthenticated) to a debug question from a caller without a verified identity."""


@dataclass(frozen=True)
class DebugAccess:
    """Who may read syncz and config_dump, as istiod 1.28 decides (``statusgen.go``).

    ``enabled`` is ``ENABLE_DEBUG_ENDPOINT_AUTH`` (istiod's default: on); ``allowed_namespaces``
    ``DEBUG_ENDPOINT_AUTH_ALLOWED_NAMESPACES``, namespaces whose callers see every proxy, as the
    system namespace's do."""

    enabled: bool = True
    system_namespace: str = SYSTEM_NAMESPACE
    allowed_namespaces: frozenset[str] = frozenset()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> DebugAccess:
        """istiod's variables; a value that is not a Go boolean is a ValueError naming it."""
        raw = env.get("ENABLE_DEBUG_ENDPOINT_AUTH", "")
        try:
            enabled = True if raw == "" else parse_go_bool(raw)
        except ValueError as err:
            raise ValueError(f"ENABLE_DEBUG_ENDPOINT_AUTH: {err}") from None
        allowed = env.get("DEBUG_ENDPOINT_AUTH_ALLOWED_NAMESPACES", "")
        return cls(enabled, allowed_namespaces=frozenset(n.strip() for n in allowed.split(",") if n.strip()))

    def refuses(self, identity: str | None) -> bool:
        """A debug question from this caller ends its stream (Unauthenticated)."""
        return self.enabled and identity is None

    def namespace_filter(self, identity: str | None) -> str:
        """The one namespace this caller may see, or ``""`` for all (istiod's ``callerNamespaceFilter``)."""
        if not self.enabled or identity is None:
            return ""
        namespace, _ = spiffe_namespace_account(identity) or ("", "")
        if namespace == self.system_namespace or namespace in self.allowed_namespaces:
            return ""
        return namespace


def spiffe_namespace_account(identity: str) -> tuple[str, str] | None:
    """``spiffe://<trust domain>/ns/<namespace>/sa/<account>`` -> ``(namespace, account)``; None else."""
    if not identity.startswith("spiffe://"):
        return None
    parts = identity.removeprefix("spiffe://").split("/")
    if len(parts) == 5 and parts[1] == "ns" and parts[3] == "sa":
        return parts[2], parts[4]
    return None


def is_debug_type(type_url: str) -> bool:
    return type_url == DEBUG_PREFIX or type_url.startswith(DEBUG_PREFIX + "/")


def unknown_type(type_url: str) -> str:
    """The error for a debug type nobody here generates (bounded: the type comes from the client)."""
    return f"unknown debug type {type_url[:200]!r}: this control plane serves {', '.join(SERVED)}"


def proxy_id(node: ProxyNode) -> str:
    """istiod's proxy ID: the ``<pod>.<namespace>`` part of a sidecar's node id (else the whole id)."""
    parts = node.id.split("~")
    return parts[2] if len(parts) >= 3 and parts[2] else node.id


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def client_config(node: ProxyNode, watches: Mapping[str, Watch]) -> csds_pb2.ClientConfig:
    """One syncz entry: the proxy, and each watched type's status sorted by type URL."""
    config = csds_pb2.ClientConfig()
    config.node.id = proxy_id(node)
    for key in SYNCZ_METADATA:
        value = node.metadata.get(key)
        if isinstance(value, str):
            config.node.metadata[key] = value
    for type_url, watch in sorted(watches.items()):
        status = watch.status()
        entry = config.generic_xds_configs.add(
            type_url=type_url,
            version_info=status.version,
            config_status=csds_pb2.ConfigStatus.Value(status.config_status),
        )
        if status.last_sent is not None:
            entry.last_updated.CopyFrom(_timestamp(status.last_sent))
        if status.error is not None:
            entry.error_state.details = status.error
            if status.last_sent is not None:
                entry.error_state.last_update_attempt.CopyFrom(_timestamp(status.last_sent))
    return config


def is_proxy(node: ProxyNode) -> bool:
    """What istiod's syncz lists: a node with ``PROXY_CONFIG`` metadata (a sidecar or gateway agent),
    or a ztunnel; not debug clients, nor proxyless gRPC apps (their bootstrap sends no ProxyConfig)."""
    return node.metadata.get("PROXY_CONFIG") is not None or node.id.startswith("ztunnel~")


def syncz(proxies: Iterable[tuple[ProxyNode, Mapping[str, Watch]]], namespace: str = "") -> list[Resource]:
    """Every proxy (of ``namespace`` when given), sorted by proxy ID."""
    configs = sorted(
        (
            client_config(node, watches)
            for node, watches in proxies
            if is_proxy(node) and (not namespace or node.namespace == namespace)
        ),
        key=lambda c: c.node.id,
    )
    return [Resource(config.node.id, config) for config in configs]


def _packed(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


_SECTIONS = (
    (CLUSTER_TYPE, dump_pb2.ClustersConfigDump, "dynamic_active_clusters", "cluster"),
    (LISTENER_TYPE, dump_pb2.ListenersConfigDump, "dynamic_listeners", "listener"),
    (ROUTE_TYPE, dump_pb2.RoutesConfigDump, "dynamic_route_configs", "route_config"),
    (ENDPOINT_TYPE, dump_pb2.EndpointsConfigDump, "dynamic_endpoint_configs", "endpoint_config"),
    (EXTENSION_CONFIG_TYPE, dump_pb2.EcdsConfigDump, "ecds_filters", "ecds_filter"),
)
"""Envoy's config-dump sections istiod answers with: type, section, its list, the entry's field."""


def config_dump(
    messages: Mapping[str, Mapping[str, Message]], versions: Mapping[str, Mapping[str, str]]
) -> list[Resource]:
    """What was generated for one proxy as Envoy's config-dump sections (unnamed, as istiod's)."""
    sections = []
    for type_url, section_type, entries, field in _SECTIONS:
        section = section_type()
        by_name = messages.get(type_url, {})
        for name in sorted(by_name):
            version = versions.get(type_url, {}).get(name, "")
            entry = getattr(section, entries).add()
            if type_url == LISTENER_TYPE:  # a listener's config sits in its active state
                entry.name = name
                entry = entry.active_state
            entry.version_info = version
            getattr(entry, field).CopyFrom(_packed(by_name[name]))
        sections.append(Resource("", section))
    return sections
