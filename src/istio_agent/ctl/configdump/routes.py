"""``proxy-config route``: istioctl's ``writer/envoy/configdump/route.go``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from istio_agent.ctl.configdump import render
from istio_agent.ctl.configdump.gosort import sort_slice
from istio_agent.ctl.configdump.messages import Msg
from istio_agent.ctl.configdump.resources import (
    ROUTE,
    as_message,
    atoi,
    describe_management,
    dig,
    raw,
    text,
)
from istio_agent.ctl.configdump.source import ConfigDumpError, Dump
from istio_agent.goformat import tabwrite

PASSTHROUGH = "PassthroughCluster"


@dataclass(frozen=True)
class RouteFilter:
    name: str = ""
    verbose: bool = True

    def verify(self, route: Msg) -> bool:
        return not self.name or self.name == text(route, "name")


def _numeric_less(a: Msg, b: Msg) -> bool:
    left, right = atoi(text(a, "name")), atoi(text(b, "name"))
    return left is not None and right is not None and left < right


def sorted_routes(dump: Dump) -> list[Msg]:
    section = dump.section("RoutesConfigDump")
    routes = [
        as_message(ROUTE, raw(entry, "route_config"))
        for key in ("dynamic_route_configs", "static_route_configs")
        for entry in raw(section, key) or []
        if raw(entry, "route_config") is not None
    ]
    if not routes:
        raise ConfigDumpError("no routes found")
    sort_slice(routes, _numeric_less)
    return routes


def describe_route_domains(domains: list[str]) -> str:
    """The shortest names a virtual host answers: those without a port, two at most, then ``+ N more...``."""
    if not domains:
        return ""
    if len(domains) == 1:
        return domains[0]
    without_port = [d for d in domains if ":" not in d or (d.count(":") > 2 and d.endswith("]"))]
    without_port = _unexpand(without_port)
    if len(without_port) > 2:
        return f"{', '.join(without_port[:2])} + {len(without_port) - 2} more..."
    return ", ".join(without_port)


def _unexpand(domains: list[str]) -> list[str]:
    unique = set(domains)
    drop = set()
    for name in domains:
        for suffix in (".svc.cluster.local", ".svc"):
            short = name.removesuffix(suffix)
            if short != name and short in unique:
                drop.add(name)
    return [name for name in domains if name not in drop]


def describe_match(match: Any) -> str:
    conditions = []
    if text(match, "prefix"):
        conditions.append(f"{text(match, 'prefix')}*")
    if text(match, "pathSeparatedPrefix"):
        conditions.append(f"PathPrefix:{text(match, 'pathSeparatedPrefix')}")
    if text(match, "path"):
        conditions.append(text(match, "path"))
    if dig(match, "safeRegex") is not None:
        conditions.append(f"regex {text(match, 'safeRegex', 'regex')}")
    return " ".join(conditions)


def _is_passthrough(route: Any) -> bool:
    return text(route, "route", "cluster") == PASSTHROUGH


def summary(dump: Dump, filter: RouteFilter, *, with_type: bool = False) -> str:
    routes = sorted_routes(dump)
    if filter.verbose:
        rows = [["NAME", "VHOST NAME", "DOMAINS", "MATCH", "VIRTUAL SERVICE"]]
    else:
        rows = [["NAME", "VIRTUAL HOSTS"]]
    for route in routes:
        if not filter.verify(route):
            continue
        name = f"route/{text(route, 'name')}" if with_type else text(route, "name")
        vhosts = route.get("virtualHosts") or []
        if not filter.verbose:
            rows.append([name, str(len(vhosts))])
            continue
        for vhost in vhosts:
            domains = describe_route_domains(vhost.get("domains") or [])
            for entry in vhost.get("routes") or []:
                if not _is_passthrough(entry):
                    rows.append(
                        [
                            name,
                            text(vhost, "name"),
                            domains,
                            describe_match(dig(entry, "match")),
                            describe_management(dig(entry, "metadata")),
                        ]
                    )
            if not vhost.get("routes"):
                rows.append([name, text(vhost, "name"), domains, "/*", "404"])
    return tabwrite(rows, padding=5)


def dump_json(dump: Dump, filter: RouteFilter) -> str:
    return render.message_slice_json([r for r in sorted_routes(dump) if filter.verify(r)]) + "\n"
