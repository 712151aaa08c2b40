"""``proxy-config cluster``: istioctl's ``writer/envoy/configdump/cluster.go``."""

from __future__ import annotations

from dataclasses import dataclass

from istio_agent.ctl.configdump import render
from istio_agent.ctl.configdump.gosort import sort_slice
from istio_agent.ctl.configdump.messages import Msg
from istio_agent.ctl.configdump.resources import (
    CLUSTER,
    as_message,
    describe_management,
    dig,
    parse_subset_key,
    raw,
    subset_key_less,
    text,
)
from istio_agent.ctl.configdump.source import ConfigDumpError, Dump
from istio_agent.goformat import tabwrite


@dataclass(frozen=True)
class ClusterFilter:
    """``--fqdn``, ``--port``, ``--subset``, ``--direction``: substrings of the cluster's name."""

    fqdn: str = ""
    port: int = 0
    subset: str = ""
    direction: str = ""

    def verify(self, cluster: Msg) -> bool:
        name = text(cluster, "name")
        if self.fqdn and self.fqdn not in name:
            return False
        if self.direction and self.direction not in name:
            return False
        if self.subset and self.subset not in name:
            return False
        return not (self.port and f"|{self.port}|" not in name)


def sorted_clusters(dump: Dump) -> list[Msg]:
    """Dynamic active then static clusters, sorted as istioctl sorts them; error when there are none."""
    section = dump.section("ClustersConfigDump")
    clusters = [
        as_message(CLUSTER, raw(entry, "cluster"))
        for key in ("dynamic_active_clusters", "static_clusters")
        for entry in raw(section, key) or []
        if raw(entry, "cluster") is not None
    ]
    if not clusters:
        raise ConfigDumpError("no clusters found")
    sort_slice(clusters, lambda a, b: subset_key_less(text(a, "name"), text(b, "name")))
    return clusters


def summary(dump: Dump, filter: ClusterFilter, *, with_type: bool = False) -> str:
    clusters = sorted_clusters(dump)
    header = ["SERVICE FQDN", "PORT", "SUBSET", "DIRECTION", "TYPE", "DESTINATION RULE"]
    rows = [["NAME", *header] if with_type else header]
    for cluster in clusters:
        if not filter.verify(cluster):
            continue
        name = text(cluster, "name")
        kind = text(cluster, "type") or "STATIC"
        rule = describe_management(dig(cluster, "metadata"))
        if len(name.split("|")) > 3:
            direction, subset, fqdn, port = parse_subset_key(name)
            row = [fqdn, str(port), subset or "-", direction, kind, rule]
            rows.append([f"cluster/{name}", *row] if with_type else row)
        elif with_type and name:
            rows.append([f"cluster/{name}", f"cluster/{name}", "-", "-", "-", kind, rule])
        else:
            rows.append([name, "-", "-", "-", kind, rule])
    return tabwrite(rows, padding=5)


def dump_json(dump: Dump, filter: ClusterFilter) -> str:
    return render.message_slice_json([c for c in sorted_clusters(dump) if filter.verify(c)]) + "\n"
