"""``proxy-config listener``: istioctl's ``writer/envoy/configdump/listener.go``."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from istio_agent.ctl.configdump import render
from istio_agent.ctl.configdump.gosort import sort_slice
from istio_agent.ctl.configdump.messages import Msg, plain
from istio_agent.ctl.configdump.resources import LISTENER, as_message, dig, number, raw, text
from istio_agent.ctl.configdump.routes import describe_match
from istio_agent.ctl.configdump.source import ConfigDumpError, Dump
from istio_agent.goformat import tabwrite

HTTP_FILTER = "envoy.filters.network.http_connection_manager"
TCP_FILTER = "envoy.filters.network.tcp_proxy"
BLACKHOLE = "BlackHoleCluster"
PROTOCOL_NAMES = (
    ("App: HTTP TLS", ["http/1.0", "http/1.1", "h2c", "istio-http/1.0", "istio-http/1.1", "istio-h2"]),
    ("App: Istio HTTP Plain", ["istio", "istio-http/1.0", "istio-http/1.1", "istio-h2"]),
    ("App: TCP TLS", ["istio-peer-exchange", "istio"]),
    ("App: HTTP", ["http/1.0", "http/1.1", "h2c"]),
)


@dataclass(frozen=True)
class ListenerFilter:
    address: str = ""
    port: int = 0
    type: str = ""
    verbose: bool = True

    def verify(self, listener: Msg) -> bool:
        if self.address:
            addresses = [*additional_addresses(listener), address(listener)]
            if not any(a.lower() == self.address.lower() for a in addresses):
                return False
        if self.port and port(listener) != self.port:
            return False
        return not (self.type and listener_type(listener).lower() != self.type.lower())


def filter_chains(listener: Msg) -> list[Any]:
    chains = list(listener.get("filterChains") or [])
    if dig(listener, "defaultFilterChain") is not None:
        chains.append(listener["defaultFilterChain"])
    return chains


def _holds_blackhole(filter: Any) -> bool:
    """istioctl looks for the name in the TCP proxy's serialized bytes: its strings (values, type
    URLs, map and Struct keys) are what those bytes spell out."""
    typed = dig(filter, "typedConfig")
    return typed is not None and any(BLACKHOLE in item for item in _strings(plain(typed)))


def _strings(node: Any) -> Iterator[str]:
    """Every string in a plain JSON tree, keys included (no field name spells BlackHoleCluster)."""
    pending = [node]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            yield from item.keys()
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)


def listener_type(listener: Msg) -> str:
    """HTTP, TCP, HTTP+TCP or UNKNOWN, by the filters of the listener's chains."""
    http = tcp = 0
    for chain in filter_chains(listener):
        for filter in dig(chain, "filters") or []:
            if text(filter, "name") == HTTP_FILTER:
                http += 1
            elif text(filter, "name") == TCP_FILTER and not _holds_blackhole(filter):
                tcp += 1
    if http:
        return "HTTP" if not tcp else "HTTP+TCP"
    return "TCP" if tcp else "UNKNOWN"


def address(listener: Msg) -> str:
    if dig(listener, "address", "socketAddress") is not None:
        return text(listener, "address", "socketAddress", "address")
    if dig(listener, "address", "pipe") is not None:
        return text(listener, "address", "pipe", "path")
    return ""


def additional_addresses(listener: Msg) -> list[str]:
    return [
        text(extra, "address", "socketAddress", "address")
        for extra in listener.get("additionalAddresses") or []
    ]


def port(listener: Msg) -> int:
    return number(listener, "address", "socketAddress", "portValue")


def describe_chain_match(match: Any) -> str:
    """MATCH: SNI, transport, application protocols (by Istio's names), destination addresses and port."""
    parts = []
    if dig(match, "serverNames"):
        parts.append(f"SNI: {','.join(match['serverNames'])}")
    if text(match, "transportProtocol"):
        parts.append(f"Trans: {text(match, 'transportProtocol')}")
    protocols = dig(match, "applicationProtocols")
    if protocols:
        named = next((name for name, known in PROTOCOL_NAMES if known == protocols), None)
        parts.append(named or f"App: {','.join(protocols)}")
    destination_port = dig(match, "destinationPort")
    port_text = f":{destination_port}" if destination_port is not None else ""
    ranges = dig(match, "prefixRanges")
    if ranges:
        cidrs = ",".join(f"{text(r, 'addressPrefix')}/{number(r, 'prefixLen')}" for r in ranges)
        parts.append(f"Addr: {cidrs}{port_text}")
    elif port_text:
        parts.append(f"Addr: *{port_text}")
    return "; ".join(parts) if parts else "ALL"


def describe_filters(filters: list[Any]) -> str:
    """DESTINATION: the route or cluster the chain's HTTP connection manager or TCP proxy leads to."""
    for filter in filters:
        name = text(filter, "name")
        config = dig(filter, "typedConfig") or {}
        if name == HTTP_FILTER:
            if dig(config, "routeConfig") is not None:
                return _describe_route_config(config["routeConfig"])
            if text(config, "rds", "routeConfigName"):
                return f"Route: {text(config, 'rds', 'routeConfigName')}"
            return "HTTP"
        if name == TCP_FILTER and not _holds_blackhole(filter):
            cluster = text(config, "cluster")
            return cluster if "Cluster" in cluster else f"Cluster: {cluster}"
    return "Non-HTTP/Non-TCP"


def _describe_route_config(route: Any) -> str:
    cluster = _match_all_cluster(route)
    if cluster:
        return cluster
    hosts = []
    for vhost in dig(route, "virtualHosts") or []:
        domains = vhost.get("domains") or []
        described = "" if domains == ["*"] else "/".join(domains)
        routes = ", ".join(describe_match(dig(r, "match")) for r in vhost.get("routes") or [])
        hosts.append(routes if not described else f"{described} {routes}")
    return f"Inline Route: {'; '.join(hosts)}"


def _match_all_cluster(route: Any) -> str:
    vhosts = dig(route, "virtualHosts") or []
    if len(vhosts) != 1 or (vhosts[0].get("domains") or []) != ["*"]:
        return ""
    routes = vhosts[0].get("routes") or []
    if len(routes) != 1 or text(routes[0], "match", "prefix") != "/":
        return ""
    if dig(routes[0], "route") is None or dig(routes[0], "route", "cluster") is None:
        return ""
    cluster = text(routes[0], "route", "cluster")
    return cluster if "Cluster" in cluster else f"Cluster: {cluster}"


def all_listeners(dump: Dump) -> list[Msg]:
    """Active dynamic listeners, then static ones, in the dump's order; error when there are none."""
    try:
        section = dump.section("ListenersConfigDump")
    except ConfigDumpError as err:
        raise ConfigDumpError(f"listener dump: {err}") from None
    listeners = [
        as_message(LISTENER, raw(entry, "active_state", "listener"))
        for entry in raw(section, "dynamic_listeners") or []
        if raw(entry, "active_state", "listener") is not None
    ]
    listeners += [
        as_message(LISTENER, raw(entry, "listener"))
        for entry in raw(section, "static_listeners") or []
        if raw(entry, "listener") is not None
    ]
    if not listeners:
        raise ConfigDumpError("no listeners found")
    return listeners


def _listener_less(a: Msg, b: Msg) -> bool:
    if port(a) != port(b):
        return port(a) < port(b)
    if address(a) != address(b):
        return address(a) < address(b)
    return listener_type(a) < listener_type(b)


def summary(dump: Dump, filter: ListenerFilter, *, with_type: bool = False) -> str:
    listeners = [listener for listener in all_listeners(dump) if filter.verify(listener)]
    sort_slice(listeners, _listener_less)
    header = ["ADDRESSES", "PORT", *(["MATCH", "DESTINATION"] if filter.verbose else ["TYPE"])]
    rows = [["NAME", *header] if with_type else header]
    for listener in listeners:
        addresses = ",".join([address(listener), *additional_addresses(listener)])
        name = [f"listener/{text(listener, 'name')}"] if with_type else []
        if filter.verbose:
            matches = [
                (
                    describe_chain_match(dig(chain, "filterChainMatch")),
                    describe_filters(dig(chain, "filters") or []),
                )
                for chain in filter_chains(listener)
            ]
            sort_slice(matches, lambda a, b: a[1] > b[1])
            for match, destination in matches:
                rows.append([*name, addresses, str(port(listener)), match, destination])
        else:
            rows.append([*name, addresses, str(port(listener)), listener_type(listener)])
    return tabwrite(rows, padding=1)


def dump_json(dump: Dump, filter: ListenerFilter) -> str:
    return render.message_slice_json([item for item in all_listeners(dump) if filter.verify(item)]) + "\n"
