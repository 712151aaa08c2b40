"""``agentctl proxy-status PROXY``: what the control plane would send that proxy against what its Envoy holds.

istioctl 1.28 (``istioctl/pkg/proxystatus/proxystatus.go``, a proxy argument) reads the Envoy's
``/config_dump`` (or ``--file``, ``-`` for stdin), asks the control plane for
``istio.io/debug/config_dump`` with the resource name ``<pod>.<ns>``, and prints
``compare.NewXdsComparator(...).Diff()`` (``istioctl/pkg/writer/compare``): for clusters, listeners
and routes in turn, "<Section> Match" or "<Section> Don't Match" and a unified diff of jsonpb's
four-space-indented text, istiod's side first, with seven lines of context; routes add when Envoy
last loaded RDS, in the local zone. What a dump holds beside the config itself is not compared
(``istioctl/pkg/util/configdump``): only dynamic active clusters, active listeners (the draining
state and the listener's entry name dropped) and dynamic route configs, sorted by name (virtual hosts
too), their ``version_info`` and ``last_updated`` cleared.

Both sides are read into the Go types istioctl uses and printed by one jsonpb printer
(:mod:`istio_agent.ctl.configdump.messages`); the control plane's binary sections go through
protobuf JSON first. The diff is Python's ``difflib``, the algorithm go-difflib ports line for line.
"""

from __future__ import annotations

import calendar
import difflib
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from istio_agent.ctl.configdump import binary, source
from istio_agent.ctl.configdump.gosort import sort_slice
from istio_agent.ctl.configdump.messages import Msg, jsonpb_text
from istio_agent.ctl.configdump.resources import dig, section_message, text
from istio_agent.ctl.configdump.source import ConfigDumpError, Dump
from istio_agent.ctl.proxystatus import (
    Agent,
    ControlPlaneTarget,
    ProxyStatusError,
    Report,
    ask_agent,
    ask_control_plane,
    debug_node,
)

CONFIG_DUMP_TYPE = "istio.io/debug/config_dump"
CONTEXT = 7
"""Lines of context around each change (istioctl's comparator)."""
CLUSTER_URL = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
LISTENER_URL = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE_URL = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_TIMESTAMP = re.compile(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?Z")
ZTUNNEL_KEYS = ("workloads", "services", "policies", "certificates")
"""What ztunnel's ``/config_dump`` holds instead of Envoy's ``configs``."""


# -- the diff --------------------------------------------------------------------------------------


def split_lines(value: str) -> list[str]:
    """go-difflib's ``SplitLines``: every line keeps its newline, and the last one gets one too."""
    return [line + "\n" for line in value.split("\n")]


def unified_diff(a: str, b: str, from_file: str, to_file: str, context: int = CONTEXT) -> str:
    """go-difflib's ``GetUnifiedDiffString``: empty when the texts are the same."""
    lines = difflib.unified_diff(split_lines(a), split_lines(b), from_file, to_file, n=context, lineterm="\n")
    return "".join(lines)


# -- what is compared ------------------------------------------------------------------------------


def _retype(entry: Any, path: tuple[str, ...], url: str) -> None:
    """istioctl forces the v3 type URL on each resource before comparing."""
    resource = dig(entry, *path)
    if isinstance(resource, dict) and "@type" in resource:
        resource["@type"] = url


def _by_name(entries: list[Any], *path: str) -> None:
    sort_slice(entries, lambda a, b: text(a, *path, "name") < text(b, *path, "name"))


def _strip(entry: Any) -> None:
    if isinstance(entry, dict):
        entry.pop("versionInfo", None)
        entry.pop("lastUpdated", None)


def clusters(dump: Dump) -> Msg:
    """``GetDynamicClusterDump(true)``: dynamic active clusters by name, without versions and times."""
    section = section_message("ClustersConfigDump", dump.section("ClustersConfigDump"))
    entries = list(section.get("dynamicActiveClusters") or [])
    for entry in entries:
        _retype(entry, ("cluster",), CLUSTER_URL)
    _by_name(entries, "cluster")
    for entry in entries:
        _strip(entry)
    return Msg({"dynamicActiveClusters": entries}) if entries else Msg()


def listeners(dump: Dump) -> Msg:
    """``GetDynamicListenerDump(true)``: active listeners by name; draining states, entry names,
    versions and times dropped (a warming or error state stays)."""
    section = section_message("ListenersConfigDump", dump.section("ListenersConfigDump"))
    entries = []
    for entry in section.get("dynamicListeners") or []:
        entry.pop("drainingState", None)
        if "activeState" in entry:
            entries.append(entry)
    for entry in entries:
        _retype(entry, ("activeState", "listener"), LISTENER_URL)
    _by_name(entries, "activeState", "listener")
    for entry in entries:
        _strip(entry["activeState"])
        entry.pop("name", None)
    return Msg({"dynamicListeners": entries}) if entries else Msg()


def routes(dump: Dump) -> Msg:
    """``GetDynamicRouteDump(true)``: dynamic route configs by name, each one's virtual hosts by name,
    without versions and times."""
    section = section_message("RoutesConfigDump", dump.section("RoutesConfigDump"))
    entries = list(section.get("dynamicRouteConfigs") or [])
    for entry in entries:
        _retype(entry, ("routeConfig",), ROUTE_URL)
    _by_name(entries, "routeConfig")
    for entry in entries:
        hosts = dig(entry, "routeConfig", "virtualHosts")
        if isinstance(hosts, list):
            _by_name(hosts)
        _strip(entry)
    return Msg({"dynamicRouteConfigs": entries}) if entries else Msg()


SECTIONS: dict[str, Callable[[Dump], Msg]] = {"clusters": clusters, "listeners": listeners, "routes": routes}


def section_text(kind: str, dump: Dump) -> str:
    """jsonpb's text of one side's section, or the error istioctl compares in its place."""
    try:
        return jsonpb_text(SECTIONS[kind](dump), "    ")
    except ConfigDumpError as err:
        return str(err)


def last_route_update(dump: Dump) -> float | None:
    """``GetLastUpdatedDynamicRouteTime``: the latest ``last_updated`` of Envoy's dynamic route configs
    (seconds; None when none is after the epoch). ConfigDumpError when there is no route section."""
    section = section_message("RoutesConfigDump", dump.section("RoutesConfigDump"))
    latest = (0, 0)
    for entry in section.get("dynamicRouteConfigs") or []:
        match = _TIMESTAMP.fullmatch(text(entry, "lastUpdated"))
        if match:
            fields = [int(match.group(i)) for i in range(1, 7)]
            seconds = calendar.timegm((*fields, 0, 0, 0))
            latest = max(latest, (seconds, int((match.group(7) or "0").ljust(9, "0"))))
    return latest[0] + latest[1] / 1e9 if latest > (0, 0) else None


def rfc1123(seconds: float) -> str:
    """Go's ``time.RFC1123`` in the local zone: ``Mon, 02 Jan 2006 15:04:05 MST``."""
    t = time.localtime(int(seconds))
    return (
        f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} {t.tm_year:04d} "
        f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} {t.tm_zone}"
    )


@dataclass(frozen=True)
class Comparison:
    stdout: str
    error: str | None = None
    """istioctl's error after what it printed (Envoy's dump has no route section)."""


def compare(istiod: Dump, envoy: Dump) -> Comparison:
    """istioctl's ``Diff``: clusters, listeners, routes, each "Match" or "Don't Match" and its diff."""
    out: list[str] = []
    for kind, title in (("clusters", "Clusters"), ("listeners", "Listeners"), ("routes", "Routes")):
        diff = unified_diff(
            section_text(kind, istiod), section_text(kind, envoy), f"Istiod {title}", f"Envoy {title}"
        )
        suffix = ""
        if kind == "routes":
            try:
                loaded = last_route_update(envoy)
            except ConfigDumpError as err:
                return Comparison("".join(out), str(err))
            suffix = f" (RDS last loaded at {rfc1123(loaded)})" if loaded is not None else ""
        out.append(f"{title} Don't Match{suffix}\n{diff}\n" if diff else f"{title} Match{suffix}\n")
    return Comparison("".join(out))


# -- the two sides ---------------------------------------------------------------------------------


def istiod_dump(responses: Mapping[str, discovery_pb2.DiscoveryResponse]) -> Dump:
    """The first answer with resources, its sections as a dump (``NewXdsComparator``); an
    ``Any`` of a type not known here reads as its type URL alone (istioctl's non-strict resolver)."""
    for response in responses.values():
        if response.resources:
            try:
                configs = [binary.any_to_json(resource) for resource in response.resources]
            except (TypeError, ValueError, json_format.Error, DecodeError) as err:
                raise ProxyStatusError(f"the control plane's config dump does not read: {err}") from None
            return Dump({"configs": configs})
    raise ProxyStatusError("unable to find config dump in Istiod responses")


def is_ztunnel_dump(data: bytes) -> bool:
    """A ztunnel's admin answer (istioctl tells a ztunnel by its pod; without Kubernetes, by its dump)."""
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return False
    return (
        isinstance(document, dict) and "configs" not in document and any(k in document for k in ZTUNNEL_KEYS)
    )


def pod_and_namespace(proxy: str, namespace: str) -> tuple[str, str]:
    """istioctl's ``[<type>/]<name>[.<namespace>]``; only pods can be named here (no Kubernetes to
    find a deployment's pod)."""
    slash = proxy.rfind("/")
    kind, name = (proxy[:slash], proxy[slash + 1 :]) if slash > 0 else ("", proxy)
    if kind not in ("", "pod", "pods", "po"):
        raise ProxyStatusError(f"{proxy}: only a pod can be named without Kubernetes (<pod>[.<namespace>])")
    pod, dot, ns = name.rpartition(".")
    return (pod, ns) if dot else (name, namespace)


# -- the command -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DiffOptions:
    """What ``agentctl proxy-status PROXY`` was asked (see cli/agentctl.py for the flags)."""

    proxy: str
    namespace: str = "default"
    """The namespace of a PROXY without one (istioctl's ``-n``, else the kubeconfig's: default)."""
    target: ControlPlaneTarget | None = None
    agents: Sequence[Agent] = ()
    admin_address: str = source.DEFAULT_ADMIN
    file: str | None = None
    timeout: float = 10.0
    identity: tuple[str, str] = ("istio-system", "default")


async def envoy_config(options: DiffOptions) -> bytes:
    """Envoy's whole dump (istioctl asks ``config_dump`` without a mask), or the saved one."""
    try:
        if options.file is not None:
            return source.read_file(options.file)
        return await source.fetch_ok(options.admin_address, "/config_dump", options.timeout)
    except ConfigDumpError as err:
        raise ProxyStatusError(f"could not contact sidecar: {err}") from None


async def ask_config_dump(options: DiffOptions, proxy_id: str) -> dict[str, discovery_pb2.DiscoveryResponse]:
    """The control plane's config for ``proxy_id``: directly, or through the tap of the agent named so
    (else the first agent given; the tap asks as its own workload, so it must share the namespace)."""
    request = discovery_pb2.DiscoveryRequest(
        type_url=CONFIG_DUMP_TYPE, resource_names=[proxy_id], node=debug_node(*options.identity)
    )
    if options.target is not None:
        response = await ask_control_plane(options.target, request, options.timeout)
        return {"": response}
    if not options.agents:
        raise ProxyStatusError("no control plane and no agent to ask")
    agent = next((a for a in options.agents if a.name == proxy_id), options.agents[0])
    try:
        return {"": await ask_agent(agent.address, request, options.timeout)}
    except ProxyStatusError as err:
        raise ProxyStatusError(f"agent {agent.name or agent.address}: {err}") from None


async def run(options: DiffOptions) -> Report:
    """Envoy's side first (as istioctl), then the control plane's, then the comparison; a
    ProxyStatusError is istioctl's error (exit 1) after any text already printed."""
    pod, namespace = pod_and_namespace(options.proxy, options.namespace)
    envoy_bytes = await envoy_config(options)
    if is_ztunnel_dump(envoy_bytes):
        return Report(f"Sync diff is not available for ztunnel pod {pod}.{namespace}\n", [])
    try:
        envoy = Dump.from_bytes(envoy_bytes)
    except ConfigDumpError as err:
        raise ProxyStatusError(str(err)) from None
    istiod = istiod_dump(await ask_config_dump(options, f"{pod}.{namespace}"))
    result = compare(istiod, envoy)
    if result.error is not None:
        raise DiffError(result.stdout, result.error)
    return Report(result.stdout, [])


class DiffError(ProxyStatusError):
    """istioctl's error after part of the comparison was printed (``printed``)."""

    def __init__(self, printed: str, message: str) -> None:
        super().__init__(message)
        self.printed = printed
