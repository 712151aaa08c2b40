"""Envoy node identity: service node ID, service cluster, locality and node metadata (pure functions).

istiod reads the node ID and metadata sent on the first xDS request to know who the proxy is (pod,
namespace, IPs, labels, cluster ID...), so names and shapes follow Istio's ``BootstrapNodeMetadata``
(Istio: pkg/bootstrap/config.go, pkg/model/proxy.go).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from istio_agent.config import proxy_config
from istio_agent.config.proxy_config import ProxyConfig

LOCALITY_LABEL = "istio-locality"
POD_TEMPLATE_HASH = "pod-template-hash"
APP_LABELS = ("app", "app.kubernetes.io/name", "service.istio.io/canonical-name")
DEFAULT_SERVICE_CLUSTER = "istio-proxy"


def service_node(proxy_type: str, ips: Sequence[str], pod_name: str, namespace: str, domain: str) -> str:
    """``TYPE~FIRST_IP~POD.NAMESPACE~DOMAIN`` (empty IP when there is none); only the first IP is used."""
    first_ip = ips[0] if ips else ""
    return f"{proxy_type}~{first_ip}~{pod_name}.{namespace}~{domain}"


def service_cluster(configured: str, labels: Mapping[str, str], workload_name: str, namespace: str) -> str:
    """Envoy's node cluster: an explicit serviceCluster, else app label, workload name or istio-proxy.

    ``istio-proxy`` (the default) counts as unset; the app label is the first of ``app``,
    ``app.kubernetes.io/name`` and ``service.istio.io/canonical-name``.
    """
    if configured and configured != DEFAULT_SERVICE_CLUSTER:
        return configured
    app = next((labels[name] for name in APP_LABELS if labels.get(name)), "")
    if app:
        return f"{app}.{namespace}"
    if workload_name:
        return f"{workload_name}.{namespace}"
    if namespace:
        return f"{DEFAULT_SERVICE_CLUSTER}.{namespace}"
    return DEFAULT_SERVICE_CLUSTER


def locality(label: str) -> dict[str, str]:
    """Envoy node locality from an ``istio-locality`` label (``region.zone.subzone`` or with ``/``)."""
    parts = sanitize_locality(label).split("/", 2) if label else []
    return {key: value for key, value in zip(("region", "zone", "sub_zone"), parts, strict=False) if value}


def sanitize_locality(label: str) -> str:
    """Labels cannot contain ``/``, so the label uses ``.``; Istio's locality form uses ``/``."""
    return label.replace(".", "/")


def pilot_san(discovery_address: str) -> str:
    """The SAN expected on istiod's certificate: the discovery host, ``localhost`` meaning istiod."""
    host = discovery_address.rpartition(":")[0].strip("[]") or discovery_address
    return "istiod.istio-system.svc" if host == "localhost" else host


def proxy_config_json(config: ProxyConfig) -> dict[str, Any]:
    """Node metadata ``PROXY_CONFIG``: the ProxyConfig as protobuf JSON (see ``ProxyConfig.to_json``)."""
    return config.to_json()


def duration_json(value: timedelta) -> str:
    """A protobuf JSON Duration (``5s``, ``1.500s``)."""
    return proxy_config.duration_json(value)


# -- downward API files -----------------------------------------------------------------------------
_GO_ESCAPE = re.compile(r'\\(x[0-9a-fA-F]{2}|[0-7]{3}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[abfnrtv\\"])')
_SIMPLE_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}


def parse_downward_api(text: str) -> dict[str, str]:
    """Parse a Kubernetes downward-API labels/annotations file: ``key="Go-quoted value"`` per line.

    Lines without ``=`` are skipped (as Istio does); a value that is not a valid quoted string is an
    error naming the key, since silently dropping a label would change the workload's identity.
    """
    result: dict[str, str] = {}
    for line in text.split("\n"):
        key, sep, quoted = line.partition("=")
        if not sep:
            continue
        try:
            result[key] = go_unquote(quoted)
        except ValueError as err:
            raise ValueError(f"value of {key!r}: {err}") from None
    return result


def go_unquote(quoted: str) -> str:
    """Undo Go's ``%q`` quoting of a string (kubelet writes downward-API values that way)."""
    if len(quoted) < 2 or quoted[0] != '"' or quoted[-1] != '"':
        raise ValueError("not a double-quoted string")
    body = quoted[1:-1]
    out = bytearray()
    pos = 0
    while pos < len(body):
        char = body[pos]
        if char == '"' or char == "\n":
            raise ValueError("unescaped quote or newline inside the value")
        if char != "\\":
            out += char.encode()
            pos += 1
            continue
        match = _GO_ESCAPE.match(body, pos)
        if not match:
            raise ValueError(f"invalid escape at offset {pos}")
        escape = match.group(1)
        if escape[0] == "x":
            out.append(int(escape[1:], 16))
        elif escape[0] in "01234567":
            if int(escape, 8) > 255:
                raise ValueError(f"octal escape out of range at offset {pos}")
            out.append(int(escape, 8))
        elif escape[0] in "uU":
            out += chr(int(escape[1:], 16)).encode("utf-8", errors="replace")
        else:
            out += _SIMPLE_ESCAPES.get(escape, escape).encode()
        pos = match.end()
    return out.decode("utf-8", errors="replace")


# -- metadata ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MetadataSources:
    """Inputs of the node metadata, already read from env, flags and pod files."""

    proxy_metadata: Mapping[str, str] = field(default_factory=dict)
    meta_env: Mapping[str, str] = field(default_factory=dict)
    meta_json: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    dns_proxy_addr: str = ""
    istio_version: str = ""
    instance_ips: Sequence[str] = ()
    envoy_status_port: int = 15021
    envoy_prometheus_port: int = 15090
    pod_name: str = ""
    namespace: str = ""
    service_account: str = ""
    cluster_id: str = ""
    pod_labels: Mapping[str, str] | None = None
    pod_annotations: Mapping[str, str] | None = None
    pilot_san: Sequence[str] | None = None
    workload_identity_socket_file: str = ""
    proxy_config: Mapping[str, Any] = field(default_factory=dict)
    exit_on_zero_active_connections: bool = False
    skip_deprecated_logs: bool = False
    outlier_log_path: str = ""


def raw_metadata(sources: MetadataSources) -> dict[str, Any]:
    """Untyped metadata: proxyMetadata ``ISTIO_META_*``, then env (env wins), METAJSON, DNS_PROXY_ADDR."""
    raw: dict[str, Any] = {}
    prefix = "ISTIO_META_"
    for key, value in sources.proxy_metadata.items():
        if key.startswith(prefix) and len(key) > len(prefix):
            raw[key[len(prefix) :]] = value
    raw.update((key, value) for key, value in sources.meta_env.items() if key)
    for document in sources.meta_json.values():
        raw.update(document)
    if sources.dns_proxy_addr:
        raw["DNS_PROXY_ADDR"] = sources.dns_proxy_addr
    return raw


def build_metadata(sources: MetadataSources) -> dict[str, Any]:
    """The node metadata Envoy sends to istiod: typed keys computed here win over raw keys."""
    raw = raw_metadata(sources)
    typed: dict[str, Any] = {}
    typed["ISTIO_VERSION"] = raw.get("ISTIO_VERSION") or sources.istio_version
    typed["INSTANCE_IPS"] = ",".join(dict.fromkeys(sources.instance_ips))
    typed["ENVOY_STATUS_PORT"] = sources.envoy_status_port
    typed["ENVOY_PROMETHEUS_PORT"] = sources.envoy_prometheus_port
    if sources.exit_on_zero_active_connections:
        typed["EXIT_ON_ZERO_ACTIVE_CONNECTIONS"] = "true"
    if sources.skip_deprecated_logs:
        typed["ENVOY_SKIP_DEPRECATED_LOGS"] = "true"
    if sources.workload_identity_socket_file:
        typed["WORKLOAD_IDENTITY_SOCKET_FILE"] = sources.workload_identity_socket_file
    if sources.proxy_config:
        typed["PROXY_CONFIG"] = dict(sources.proxy_config)
    for key, value in (
        ("NAME", sources.pod_name),
        ("NAMESPACE", sources.namespace),
        ("SERVICE_ACCOUNT", sources.service_account),
        ("CLUSTER_ID", sources.cluster_id or raw.get("CLUSTER_ID", "")),
    ):
        if value:
            typed[key] = value

    static_labels = {str(k): str(v) for k, v in sources.meta_json.get("LABELS", {}).items()}
    labels = dict(static_labels)
    if sources.pod_labels is not None:
        labels.update((k, v) for k, v in sources.pod_labels.items() if k != POD_TEMPLATE_HASH)
    if labels.get(LOCALITY_LABEL):
        labels[LOCALITY_LABEL] = sanitize_locality(labels[LOCALITY_LABEL])
    if static_labels:
        typed["STATIC_LABELS"] = static_labels
    if labels:
        typed["LABELS"] = labels
    if sources.pod_annotations:
        typed["ANNOTATIONS"] = dict(sources.pod_annotations)
    if sources.pilot_san is not None:
        typed["PILOT_SAN"] = list(sources.pilot_san)
    if sources.outlier_log_path:
        typed["OUTLIER_LOG_PATH"] = sources.outlier_log_path
    return {**raw, **typed}
