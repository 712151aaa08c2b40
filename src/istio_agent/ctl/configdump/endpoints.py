"""Endpoints two ways, as istioctl: ``endpoint`` from Envoy's ``/clusters?format=json``
(``writer/envoy/clusters/clusters.go``) and the EDS view of a config dump with ``include_eds``
(``writer/envoy/configdump/endpoint.go``: the hidden ``eds`` command and ``all``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from istio_agent.ctl.configdump import descriptors, render
from istio_agent.ctl.configdump.gosort import sort_slice
from istio_agent.ctl.configdump.messages import MessageError, Msg, read
from istio_agent.ctl.configdump.resources import (
    LOAD_ASSIGNMENT,
    as_message,
    dig,
    number,
    raw,
    subset_key_less,
    text,
)
from istio_agent.ctl.configdump.source import ConfigDumpError, Dump, parse
from istio_agent.goformat import tabwrite


@dataclass(frozen=True)
class EndpointFilter:
    """``--address``, ``--port``, ``--cluster``, ``--status`` (address, cluster and status case-insensitive)."""

    address: str = ""
    port: int = 0
    cluster: str = ""
    status: str = ""

    def empty(self) -> bool:
        return not (self.address or self.port or self.cluster or self.status)

    def _rest(self, port: int, cluster: str, status: str) -> bool:
        if self.port and port != self.port:
            return False
        if self.cluster and cluster.lower() != self.cluster.lower():
            return False
        return not (self.status and status.lower() != self.status.lower())


# -- /clusters?format=json -------------------------------------------------------------------------------
def read_clusters(data: bytes) -> list[Msg]:
    """The ``cluster_statuses`` of Envoy's admin ``Clusters`` answer."""
    document = parse(data, "cluster_statuses")
    desc = descriptors.message("envoy.admin.v3.Clusters")
    assert desc is not None
    try:
        clusters = read(desc, document)
    except MessageError as err:
        raise ConfigDumpError(f"error unmarshalling config dump response from Envoy: {err}") from None
    return list(clusters.get("clusterStatuses") or [])


def host_address(host: Any) -> str:
    if dig(host, "address", "socketAddress") is not None:
        return text(host, "address", "socketAddress", "address")
    if dig(host, "address", "pipe") is not None:
        return "unix://" + text(host, "address", "pipe", "path")
    internal = dig(host, "address", "envoyInternalAddress")
    if internal is not None and "serverListenerName" in internal:
        return f"envoy://{text(internal, 'serverListenerName')}/{text(internal, 'endpointId')}"
    return "unknown"


def _host_status(host: Any) -> str:
    return text(host, "healthStatus", "edsHealthStatus") or "UNKNOWN"


def _host_matches(filter: EndpointFilter, host: Any, cluster: str) -> bool:
    if filter.empty():
        return True
    if filter.address and host_address(host).lower() != filter.address.lower():
        return False
    return filter._rest(number(host, "address", "socketAddress", "portValue"), cluster, _host_status(host))


def hosts_summary(clusters: list[Msg], filter: EndpointFilter) -> str:
    """ENDPOINT, STATUS, OUTLIER CHECK, CLUSTER, sorted by address, port, cluster."""
    found = []
    for cluster in clusters:
        name = text(cluster, "name")
        for host in cluster.get("hostStatuses") or []:
            if _host_matches(filter, host, name):
                failed = dig(host, "healthStatus", "failedOutlierCheck") is True
                port = number(host, "address", "socketAddress", "portValue")
                found.append((host_address(host), port, name, _host_status(host), failed))
    sort_slice(
        found, lambda a, b: (a[0] < b[0]) if a[0] != b[0] else (a[1] < b[1]) if a[1] != b[1] else a[2] < b[2]
    )
    rows = [["ENDPOINT", "STATUS", "OUTLIER CHECK", "CLUSTER"]]
    for address, port, name, status, failed in found:
        endpoint = f"{address}:{port}" if port else address
        rows.append([endpoint, status, "FAILED" if failed else "OK", name])
    return tabwrite(rows, padding=5)


def hosts_json(clusters: list[Msg], filter: EndpointFilter) -> str:
    """The cluster statuses with at least one endpoint that passes the filter (whole, as istioctl)."""
    chosen = [
        cluster
        for cluster in clusters
        if any(
            _host_matches(filter, host, text(cluster, "name")) for host in cluster.get("hostStatuses") or []
        )
    ]
    return render.message_slice_json(chosen) + "\n"


# -- EDS in the config dump ------------------------------------------------------------------------------
def lb_addresses(endpoint: Any) -> list[str]:
    addresses = [dig(endpoint, "endpoint", "address")]
    addresses += [dig(extra, "address") for extra in dig(endpoint, "endpoint", "additionalAddresses") or []]
    out = []
    for address in addresses:
        if dig(address, "socketAddress") is not None:
            out.append(
                f"{text(address, 'socketAddress', 'address')}:{number(address, 'socketAddress', 'portValue')}"
            )
        elif dig(address, "pipe") is not None:
            out.append(text(address, "pipe", "path"))
        elif dig(address, "envoyInternalAddress", "serverListenerName") is not None:
            internal = address["envoyInternalAddress"]
            out.append(f"envoy://{text(internal, 'serverListenerName')}/{text(internal, 'endpointId')}")
        else:
            out.append("unknown")
    return out


def _lb_matches(filter: EndpointFilter, endpoint: Any, cluster: str) -> bool:
    if filter.empty():
        return True
    if filter.address and not any(a.lower() == filter.address.lower() for a in lb_addresses(endpoint)):
        return False
    port = number(endpoint, "endpoint", "address", "socketAddress", "portValue")
    return filter._rest(port, cluster, text(endpoint, "healthStatus") or "UNKNOWN")


def _filtered(config: Any, filter: EndpointFilter) -> Msg | None:
    try:
        assignment = as_message(LOAD_ASSIGNMENT, config)
    except ConfigDumpError:
        return None
    count = 0
    name = text(assignment, "clusterName")
    for locality in assignment.get("endpoints") or []:
        kept = [e for e in locality.get("lbEndpoints") or [] if _lb_matches(filter, e, name)]
        if kept:
            locality["lbEndpoints"] = kept
        else:
            locality.pop("lbEndpoints", None)
        count += len(kept)
    return assignment if count else None


def load_assignments(dump: Dump, filter: EndpointFilter) -> list[Msg]:
    """Dynamic then static load assignments with an endpoint left after filtering, sorted by cluster."""
    try:
        section = dump.section("EndpointsConfigDump")
    except ConfigDumpError:
        return []
    found = []
    for key in ("dynamic_endpoint_configs", "static_endpoint_configs"):
        for entry in raw(section, key) or []:
            assignment = _filtered(raw(entry, "endpoint_config") or {}, filter)
            if assignment is not None:
                found.append(assignment)
    sort_slice(found, lambda a, b: subset_key_less(text(a, "clusterName"), text(b, "clusterName")))
    return found


def _locality(locality: Any) -> str:
    if locality is None:
        return ""
    region, zone, sub_zone = text(locality, "region"), text(locality, "zone"), text(locality, "subZone")
    if not zone:
        return region
    return f"{region}/{zone}" if not sub_zone else f"{region}/{zone}/{sub_zone}"


def eds_summary(dump: Dump, filter: EndpointFilter, *, with_type: bool = False) -> str:
    rows = [["NAME", "STATUS", "LOCALITY", "CLUSTER"]]
    for assignment in load_assignments(dump, filter):
        for locality in assignment.get("endpoints") or []:
            for endpoint in locality.get("lbEndpoints") or []:
                address = ",".join(lb_addresses(endpoint))
                rows.append(
                    [
                        f"endpoint/{address}" if with_type else address,
                        text(endpoint, "healthStatus") or "UNKNOWN",
                        _locality(dig(locality, "locality")),
                        text(assignment, "clusterName"),
                    ]
                )
    return tabwrite(rows, padding=5)


def eds_json(dump: Dump, filter: EndpointFilter) -> str:
    return render.message_slice_json(load_assignments(dump, filter)) + "\n"
