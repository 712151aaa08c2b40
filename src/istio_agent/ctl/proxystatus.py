"""``agentctl proxy-status``: which proxies are in sync with the control plane, as istioctl shows it.

The question is istiod's ``istio.io/debug/syncz`` (see :mod:`istio_agent.controlplane.debug`),
asked either of the control plane itself (``--xds-address``; plaintext, or TLS with a token through
``istiod/dial.py``) or of agents' debug taps on their port 15004 (``--xds-via-agents``, as
``istioctl x ps`` did until 1.24), which ask on their own workload's authenticated connection.
Agents are asked concurrently, each within a timeout, at most ``--xds-via-agents-limit`` of them;
an agent that fails is reported on stderr in istioctl's words and skipped. An answer that does not
decode (not a DiscoveryResponse, or a resource that is not a ClientConfig, which istioctl refuses too)
is such a failure, and through ``--xds-address`` an error like any other.

Rendering follows istioctl (``istioctl/pkg/writer/pilot``): the table
``NAME CLUSTER ISTIOD VERSION SUBSCRIBED TYPES`` sorted by proxy ID; ``-v`` one column per type with
``SYNCED|STALE|ERROR (<age>)``, ``NOT SENT`` or ``IGNORED``; ``-o json|yaml`` each control plane's
response as istioctl prints it. Beyond istioctl, ``-v`` writes each NACKed type with its age and the
NACK's text to stderr.

Questions go over the agent's own gRPC client (:mod:`istio_agent.rpc.channel`), so agentctl loads no
grpcio; its errors read as gRPC statuses (``UNAVAILABLE: connection error: ...``), as istioctl's do.

A proxy argument asks another question, over the same dial (:func:`ask_control_plane`,
:func:`ask_agent`): that proxy's config against its Envoy's (:mod:`istio_agent.ctl.proxydiff`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.status.v3 import csds_pb2
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from istio_agent.goformat import tabwrite
from istio_agent.host import interface_addresses
from istio_agent.istiod.dial import CredentialError, IstiodCredentials, IstiodEndpoint
from istio_agent.istiod.tokens import FileTokenSource
from istio_agent.rpc.channel import Channel, RpcError
from istio_agent.xds.flavour import ADS_SERVICE, SOTW

SYNCZ_TYPE = "istio.io/debug/syncz"
DISCOVERY_RESPONSE = "envoy.service.discovery.v3.DiscoveryResponse"
CLIENT_CONFIG_TYPE = "type.googleapis.com/envoy.service.status.v3.ClientConfig"
DEFAULT_AGENT_LIMIT = 100
DEFAULT_AGENT_TIMEOUT = 10.0
DEFAULT_CONCURRENCY = 32
MISSING = "MISSING"
AUTHENTICATION_REQUIRED = "authentication required"
"""istiod's Unauthenticated answer to a debug question on a connection without an identity."""
INVALID = "INVALID"

_PREFIX = "type.googleapis.com/"
SHORT_TYPES = {
    _PREFIX + "envoy.config.cluster.v3.Cluster": "CDS",
    _PREFIX + "envoy.config.listener.v3.Listener": "LDS",
    _PREFIX + "envoy.config.route.v3.RouteConfiguration": "RDS",
    _PREFIX + "envoy.config.endpoint.v3.ClusterLoadAssignment": "EDS",
    _PREFIX + "envoy.extensions.transport_sockets.tls.v3.Secret": "SDS",
    _PREFIX + "istio.networking.nds.v1.NameTable": "NDS",
    _PREFIX + "istio.mesh.v1alpha1.ProxyConfig": "PCDS",
    _PREFIX + "envoy.config.core.v3.TypedExtensionConfig": "ECDS",
    _PREFIX + "istio.workload.Address": "WDS",
    _PREFIX + "istio.workload.Workload": "WDS",
    _PREFIX + "istio.security.Authorization": "WADS",
}
"""istioctl's short names (``GetShortType`` in Istio's ``pkg/model/xds.go``); any other type shows
as its whole type URL."""
VERBOSE_TYPES = [url for url, name in SHORT_TYPES.items() if name in ("CDS", "LDS", "EDS", "RDS", "ECDS")]
"""Columns ``-v`` always shows (istioctl's); other types get one when some proxy has them."""
CORE_TYPES = [
    url for name in ("CDS", "LDS", "EDS", "RDS") for url, short in SHORT_TYPES.items() if short == name
]
"""Listed first in SUBSCRIBED TYPES, in this order; other types follow, sorted by type URL."""
TABLE_PADDING = 5
"""istioctl's tabwriter: ``tabwriter.NewWriter(w, 0, 8, 5, ' ', 0)``."""


class ProxyStatusError(Exception):
    """The question could not be asked at all (bad credentials, unreachable control plane)."""


def short_type(type_url: str) -> str:
    return SHORT_TYPES.get(type_url, type_url)


def human_duration(seconds: float) -> str:
    """An age as kubectl prints it (``k8s.io/apimachinery`` ``HumanDuration``): 45s, 3m20s, 5h, 2d3h."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 120:
        return f"{max(s, 0)}s"
    minutes, hours, days = s // 60, s // 3600, s // 86400
    if minutes < 10:
        return _pair(minutes, "m", s % 60, "s")
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return _pair(hours, "h", minutes % 60, "m")
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return _pair(days, "d", hours % 24, "h")
    if days < 365 * 2:
        return f"{days}d"
    if days < 365 * 8:
        return _pair(days // 365, "y", days % 365, "d")
    return f"{days // 365}y"


def _pair(major: int, major_unit: str, minor: int, minor_unit: str) -> str:
    return f"{major}{major_unit}{minor}{minor_unit}" if minor else f"{major}{major_unit}"


def control_plane_info(response: discovery_pb2.DiscoveryResponse) -> tuple[str, str]:
    """(ID, version) from istiod's identifier JSON; ID is MISSING or INVALID as istioctl says."""
    identifier = response.control_plane.identifier if response.HasField("control_plane") else ""
    if not identifier:
        return MISSING, ""
    try:
        parsed = json.loads(identifier)
    except ValueError:
        return INVALID, ""
    if not isinstance(parsed, dict):
        return INVALID, ""
    info = parsed.get("Info")
    version = info.get("version", "") if isinstance(info, dict) else ""
    return str(parsed.get("ID", "")), str(version)


# -- what the responses say ------------------------------------------------------------------------


@dataclass(frozen=True)
class TypeSync:
    type_url: str
    status: str
    """SYNCED, STALE, ERROR, NOT_SENT or UNKNOWN (csds ConfigStatus names)."""
    last_updated: float | None
    error: str | None


@dataclass(frozen=True)
class ProxySync:
    proxy_id: str
    cluster: str
    namespace: str
    istiod: str
    version: str
    types: dict[str, TypeSync] = field(default_factory=dict)


def proxies(responses: Mapping[str, discovery_pb2.DiscoveryResponse]) -> list[ProxySync]:
    """Every ClientConfig of every response, sorted by proxy ID (the first answer for an ID wins)."""
    found: dict[str, ProxySync] = {}
    for response in responses.values():
        istiod, istiod_version = control_plane_info(response)
        for resource in response.resources:
            if resource.type_url != CLIENT_CONFIG_TYPE:
                continue
            config = csds_pb2.ClientConfig()
            if not resource.Unpack(config) or config.node.id in found:
                continue
            metadata = json_format.MessageToDict(config.node.metadata)
            types = {}
            for entry in config.generic_xds_configs:
                updated = entry.last_updated.ToNanoseconds() / 1e9 if entry.HasField("last_updated") else None
                error = entry.error_state.details if entry.HasField("error_state") else None
                status = csds_pb2.ConfigStatus.Name(entry.config_status)
                types[entry.type_url] = TypeSync(entry.type_url, status, updated, error)
            found[config.node.id] = ProxySync(
                proxy_id=config.node.id,
                cluster=str(metadata.get("CLUSTER_ID", "")),
                namespace=str(metadata.get("NAMESPACE", "")) or config.node.id.rpartition(".")[2],
                istiod=istiod,
                version=str(metadata.get("ISTIO_VERSION", "")) or istiod_version,
                types=types,
            )
    return [found[key] for key in sorted(found)]


def select(rows: Iterable[ProxySync], namespace: str | None, proxy: str | None) -> list[ProxySync]:
    """``-n`` keeps one namespace; a proxy name ``<pod>[.<ns>]`` keeps that proxy."""
    chosen = []
    for row in rows:
        if namespace and row.namespace != namespace:
            continue
        if proxy and row.proxy_id != proxy and row.proxy_id.rpartition(".")[0] != proxy:
            continue
        chosen.append(row)
    return chosen


# -- rendering -------------------------------------------------------------------------------------


def subscribed(row: ProxySync) -> str:
    """``N (CDS,LDS,EDS,RDS,...)`` or ``0``: types whose status is known, core types first, the rest
    by type URL (istioctl's ``xdsStatusPrintlnSubscribedTypes``)."""
    urls = {t.type_url for t in row.types.values() if t.status != "UNKNOWN"}
    ordered = [url for url in CORE_TYPES if url in urls] + sorted(urls - set(CORE_TYPES))
    if not ordered:
        return "0"
    return f"{len(ordered)} ({','.join(short_type(url) for url in ordered)})"


def cell(sync: TypeSync | None, now: float) -> str:
    if sync is None or sync.status == "UNKNOWN":
        return "IGNORED"
    if sync.status == "NOT_SENT":
        return "NOT SENT"
    if sync.last_updated is None:
        return sync.status
    return f"{sync.status} ({human_duration(now - sync.last_updated)})"


def table(rows: Sequence[ProxySync], *, verbose: bool, now: float) -> str:
    """istioctl's table, byte for byte (Go's tabwriter: a row ending in an empty cell keeps its padding)."""
    if not verbose:
        lines = [["NAME", "CLUSTER", "ISTIOD", "VERSION", "SUBSCRIBED TYPES"]]
        lines += [[r.proxy_id, r.cluster, r.istiod, r.version, subscribed(r)] for r in rows]
        return tabwrite(lines, padding=TABLE_PADDING)
    type_urls = sorted(set(VERBOSE_TYPES) | {url for row in rows for url in row.types})
    head = ["NAME", "CLUSTER", *(short_type(url) for url in type_urls), "ISTIOD", "VERSION"]
    lines = [head]
    for row in rows:
        cells = [cell(row.types.get(url), now) for url in type_urls]
        lines.append([row.proxy_id, row.cluster, *cells, row.istiod, row.version])
    return tabwrite(lines, padding=TABLE_PADDING)


def nack_notes(rows: Sequence[ProxySync], now: float) -> list[str]:
    """Beyond istioctl, for ``-v`` on stderr: each type in ERROR with its age and the NACK's text."""
    notes = []
    for row in rows:
        for sync in row.types.values():
            if sync.error is None:
                continue
            since = f" {human_duration(now - sync.last_updated)} ago" if sync.last_updated is not None else ""
            text = " ".join(str(sync.error).split())
            notes.append(f"{row.proxy_id} rejected {short_type(sync.type_url)}{since}: {text}")
    return notes


def machine_readable(responses: Mapping[str, discovery_pb2.DiscoveryResponse], output: str) -> str:
    """``-o json|yaml`` as istioctl prints them (Istio master, ``printMachineReadable``; 1.28 prints the
    table instead): each control plane's DiscoveryResponse through ``protomarshal.ToJSONWithIndent``
    (golang/protobuf's jsonpb, four-space indent; YAML through JSONToYAML), one after another, here in
    control-plane ID order. The printers are the config-dump views' (``ctl/configdump``)."""
    from istio_agent.ctl.configdump.messages import jsonpb_text
    from istio_agent.ctl.configdump.render import json_to_yaml
    from istio_agent.ctl.configdump.resources import as_message

    parts = []
    for key in sorted(responses):
        raw = json_format.MessageToDict(responses[key])
        text = jsonpb_text(as_message(DISCOVERY_RESPONSE, raw), "    ")
        parts.append(json_to_yaml(text) if output == "yaml" else text + "\n")
    return "".join(parts)


def only(
    responses: Mapping[str, discovery_pb2.DiscoveryResponse], keep: Iterable[ProxySync]
) -> dict[str, discovery_pb2.DiscoveryResponse]:
    """The responses with only the ClientConfigs of ``keep`` (``-n`` and a proxy name filter JSON too)."""
    wanted = {row.proxy_id for row in keep}
    filtered = {}
    for key, response in responses.items():
        copy = discovery_pb2.DiscoveryResponse()
        copy.CopyFrom(response)
        del copy.resources[:]
        for resource in response.resources:
            config = csds_pb2.ClientConfig()
            if (
                resource.type_url == CLIENT_CONFIG_TYPE
                and resource.Unpack(config)
                and config.node.id in wanted
            ):
                copy.resources.append(resource)
        filtered[key] = copy
    return filtered


# -- asking ----------------------------------------------------------------------------------------


ISTIOCTL_WORKLOAD = "test-1"
ISTIOCTL_ISTIO_VERSION = "65536.65536.65536"
"""What istioctl's xDS client (``pkg/adsc``) puts in its node: workload name, version metadata."""


def debug_node(namespace: str, service_account: str, ip: str | None = None) -> base_pb2.Node:
    """Who asks: the node istioctl's client sends, which istiod admits (an application node type).

    ``sidecar~<IP>~test-1.default~default.svc.cluster.local`` with metadata GENERATOR ``event``, the
    asker's NAMESPACE and SERVICE_ACCOUNT, and ISTIO_VERSION ``65536.65536.65536``. The IP is this
    machine's first private address, as istioctl's; where it has none istioctl sends an empty one,
    which istiod refuses ("no valid IP address"), so 127.0.0.1 is sent instead (docs/compatibility.md).
    """
    if ip is None:
        ip = next((address for _, address in interface_addresses()), "127.0.0.1")
    node = base_pb2.Node(id=f"sidecar~{ip}~{ISTIOCTL_WORKLOAD}.default~default.svc.cluster.local")
    node.metadata["GENERATOR"] = "event"
    node.metadata["SERVICE_ACCOUNT"] = service_account
    node.metadata["NAMESPACE"] = namespace
    node.metadata["ISTIO_VERSION"] = ISTIOCTL_ISTIO_VERSION
    return node


def decode_response(raw: bytes) -> discovery_pb2.DiscoveryResponse:
    """A DiscoveryResponse from the wire; ProxyStatusError when it does not parse."""
    try:
        return discovery_pb2.DiscoveryResponse.FromString(raw)
    except DecodeError:
        raise ProxyStatusError("malformed answer: it does not decode as a DiscoveryResponse") from None


def check_syncz(response: discovery_pb2.DiscoveryResponse) -> None:
    """Every resource of a syncz answer must be a ClientConfig that decodes (istioctl requires it)."""
    for index, resource in enumerate(response.resources):
        if resource.type_url != CLIENT_CONFIG_TYPE:
            raise ProxyStatusError(
                f"malformed answer: resource {index} is {resource.type_url or 'untyped'}, not a ClientConfig"
            )
        try:
            csds_pb2.ClientConfig.FromString(resource.value)
        except DecodeError:
            raise ProxyStatusError(
                f"malformed answer: resource {index} does not decode as a ClientConfig"
            ) from None


Check = Callable[[discovery_pb2.DiscoveryResponse], None]
"""Raises ProxyStatusError when an answer's resources are not what the question expects."""


def syncz_request(node: base_pb2.Node) -> discovery_pb2.DiscoveryRequest:
    return discovery_pb2.DiscoveryRequest(type_url=SYNCZ_TYPE, node=node)


async def ask_debug(
    channel: Channel,
    request: discovery_pb2.DiscoveryRequest,
    metadata: Sequence[tuple[str, str]],
    timeout: float,
    check: Check | None = None,
) -> discovery_pb2.DiscoveryResponse:
    """One debug question (syncz, config_dump) on a new ADS stream; the first response of the
    request's type is the answer.

    Responses arrive as bytes and are decoded here, so a malformed one is a ProxyStatusError with
    what was wrong, not the client's generic decode failure."""
    call = channel.stream(
        f"/{ADS_SERVICE}/{SOTW.method}", discovery_pb2.DiscoveryRequest, bytes, metadata=metadata
    )
    try:
        async with asyncio.timeout(timeout):
            await call.send(request)
            while True:
                raw = await call.recv()
                if raw is None:
                    raise ProxyStatusError("the stream ended without an answer")
                response = decode_response(raw)
                if response.type_url == request.type_url:
                    if check is not None:
                        check(response)
                    return response
    except TimeoutError:
        raise ProxyStatusError(f"no answer within {timeout:g}s") from None
    except RpcError as err:
        raise ProxyStatusError(f"{err.code.name}: {err.details}") from None
    finally:
        await call.cancel()


@dataclass(frozen=True)
class ControlPlaneTarget:
    address: str
    plaintext: bool = False
    root_cert: Path | None = None
    server_name: str = ""
    token_path: Path | None = None


async def ask_control_plane(
    target: ControlPlaneTarget,
    request: discovery_pb2.DiscoveryRequest,
    timeout: float,
    check: Check | None = None,
) -> discovery_pb2.DiscoveryResponse:
    """One debug question to one control plane, dialled as the agent dials istiod (``istiod/dial.py``)."""
    endpoint = IstiodEndpoint(
        purpose="XDS",
        address=target.address,
        plaintext=target.plaintext,
        root_cert=target.root_cert,
        server_name=target.server_name,
    )
    tokens = FileTokenSource(target.token_path) if target.token_path is not None else None
    credentials = IstiodCredentials(endpoint, tokens)
    try:
        material = credentials.material()
    except CredentialError as err:
        raise ProxyStatusError(str(err)) from None
    if target.token_path is not None and not target.token_path.is_file():
        raise ProxyStatusError(f"token file {target.token_path} does not exist")
    try:
        channel = credentials.channel(material)
    except (OSError, ValueError) as err:  # ssl.SSLError is an OSError
        raise ProxyStatusError(f"control plane {target.address}: {err}") from None
    try:
        return await ask_debug(channel, request, credentials.metadata(), timeout, check)
    except ProxyStatusError as err:
        hint = ""
        if str(err) == f"UNAUTHENTICATED: {AUTHENTICATION_REQUIRED}" and target.plaintext:
            hint = (
                " (istiod answers debug questions only to an authenticated caller: use its TLS port, "
                "15012, with --token, or turn ENABLE_DEBUG_ENDPOINT_AUTH off on the control plane)"
            )
        raise ProxyStatusError(f"control plane {target.address}: {err}{hint}") from None
    finally:
        channel.close()


async def from_control_plane(
    target: ControlPlaneTarget, node: base_pb2.Node, timeout: float
) -> dict[str, discovery_pb2.DiscoveryResponse]:
    """syncz from one control plane, by its control-plane ID."""
    response = await ask_control_plane(target, syncz_request(node), timeout, check_syncz)
    return {control_plane_info(response)[0]: response}


async def ask_agent(
    address: str, request: discovery_pb2.DiscoveryRequest, timeout: float, check: Check | None = None
) -> discovery_pb2.DiscoveryResponse:
    """One debug question through an agent's tap (plaintext, as istioctl asked it)."""
    try:
        channel = Channel(address)
    except ValueError as err:  # not host:port
        raise ProxyStatusError(str(err)) from None
    try:
        return await ask_debug(channel, request, (), timeout, check)
    finally:
        channel.close()


@dataclass(frozen=True)
class Agent:
    """An agent's debug tap; ``name`` (``<pod>.<ns>``) only words the messages."""

    address: str
    name: str = ""

    @classmethod
    def parse(cls, text: str) -> Agent:
        """``HOST:PORT`` or ``NAME=HOST:PORT``."""
        name, _, address = text.strip().rpartition("=")
        host, colon, port = address.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"agent address {text!r} is not HOST:PORT or NAME=HOST:PORT")
        return cls(address, name)

    def skipped(self, error: object) -> str:
        """istioctl's message for an agent that failed."""
        where = f"in Pod {self.name}" if self.name else f"at {self.address}"
        return f"Skip the agent {where} due to the error: {error}"


def read_agents(path: Path) -> list[Agent]:
    """One agent a line (``#`` comments and blank lines skipped); ValueError names the line."""
    agents = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if text:
            try:
                agents.append(Agent.parse(text))
            except ValueError as err:
                raise ValueError(f"{path}:{number}: {err}") from None
    return agents


@dataclass
class ViaAgents:
    responses: dict[str, discovery_pb2.DiscoveryResponse]
    failures: list[str]
    """istioctl's "Skip the agent ..." line for each agent that failed."""
    limited: bool
    """More agents were given than the limit allowed asking."""
    namespaces: list[frozenset[str]] = field(default_factory=list)
    """The proxies' namespaces in each agent's answer (one set per agent that answered)."""


def limit_message(limit: int) -> str:
    return (
        "Some proxies may be missing from the list because the number of visited pod hits the limit "
        f"{limit}, which can be set by `--xds-via-agents-limit` flag."
    )


AskAgent = Callable[[Agent], Awaitable[discovery_pb2.DiscoveryResponse]]


async def via_agents(
    agents: Sequence[Agent],
    node: base_pb2.Node,
    *,
    limit: int = DEFAULT_AGENT_LIMIT,
    timeout: float = DEFAULT_AGENT_TIMEOUT,
    concurrency: int = DEFAULT_CONCURRENCY,
    ask: AskAgent | None = None,
) -> ViaAgents:
    """syncz through each agent's tap (plaintext, as istioctl), at most ``concurrency`` at a time.

    Answers with the same control-plane ID are merged (the first answer for a proxy ID wins), so
    many agents of one control plane give one list, as istioctl's visited set does."""
    chosen = list(agents) if limit == 0 else list(agents)[:limit]
    gate = asyncio.Semaphore(max(1, concurrency))

    async def plaintext(agent: Agent) -> discovery_pb2.DiscoveryResponse:
        return await ask_agent(agent.address, syncz_request(node), timeout, check_syncz)

    asker = ask or plaintext

    async def one(agent: Agent) -> discovery_pb2.DiscoveryResponse | str:
        async with gate:
            try:
                async with asyncio.timeout(timeout):
                    return await asker(agent)
            except TimeoutError:
                return agent.skipped(f"no answer within {timeout:g}s")
            except ProxyStatusError as err:
                return agent.skipped(err)

    results = await asyncio.gather(*(one(agent) for agent in chosen))
    merged: dict[str, discovery_pb2.DiscoveryResponse] = {}
    seen: set[str] = set()
    failures = []
    namespaces: list[frozenset[str]] = []
    for result in results:
        if isinstance(result, str):
            failures.append(result)
            continue
        key = control_plane_info(result)[0]
        target = merged.setdefault(key, _empty_like(result))
        namespaces.append(frozenset(row.namespace for row in proxies({key: result})))
        for resource in result.resources:
            config = csds_pb2.ClientConfig()
            if resource.type_url == CLIENT_CONFIG_TYPE and resource.Unpack(config):
                if config.node.id in seen:
                    continue
                seen.add(config.node.id)
            target.resources.append(resource)
    return ViaAgents(merged, failures, limited=0 < limit < len(agents), namespaces=namespaces)


def _empty_like(response: discovery_pb2.DiscoveryResponse) -> discovery_pb2.DiscoveryResponse:
    copy = discovery_pb2.DiscoveryResponse()
    copy.CopyFrom(response)
    del copy.resources[:]
    return copy


# -- the command -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class View:
    """How to show the table: which proxies (a namespace) and in which format (one proxy is
    :mod:`istio_agent.ctl.proxydiff`'s)."""

    namespace: str | None = None
    verbosity: int = 0
    output: str = "table"


@dataclass(frozen=True)
class Options:
    """What ``agentctl proxy-status`` was asked (see cli/agentctl.py for the flags)."""

    target: ControlPlaneTarget | None
    agents: Sequence[Agent]
    view: View
    limit: int = DEFAULT_AGENT_LIMIT
    timeout: float = DEFAULT_AGENT_TIMEOUT
    concurrency: int = DEFAULT_CONCURRENCY
    identity: tuple[str, str] = ("istio-system", "default")
    """The asker's namespace and service account (istioctl's: ``default`` in the istio namespace)."""


@dataclass
class Report:
    stdout: str
    stderr: list[str]


async def run(options: Options, clock: Callable[[], float] = time.time) -> Report:
    """Ask, then render; raises ProxyStatusError when nothing could be asked at all."""
    node = debug_node(*options.identity)
    view = options.view
    stderr: list[str] = []
    if options.target is not None:
        responses = await from_control_plane(options.target, node, options.timeout)
    else:
        result = await via_agents(
            list(options.agents),
            node,
            limit=options.limit,
            timeout=options.timeout,
            concurrency=options.concurrency,
        )
        responses, stderr = result.responses, list(result.failures)
        if result.limited:
            stderr.append(limit_message(options.limit))
        stderr += partial_view_note(result.namespaces)
    rows = select(proxies(responses), view.namespace, None)
    chosen = only(responses, rows) if view.namespace else responses
    if view.output in ("json", "yaml"):
        return Report(machine_readable(chosen, view.output), stderr)
    now = clock()
    if view.verbosity > 0:
        stderr += nack_notes(rows, now)
    return Report(table(rows, verbose=view.verbosity > 0, now=now), stderr)


def partial_view_note(namespaces: Sequence[frozenset[str]]) -> list[str]:
    """When agents' answers each covered one namespace, and not the same one, the control plane
    filters (istiod 1.28 and later answer a workload outside its system namespace only about that
    namespace): say so, since the merged table would otherwise look complete. (One answer of one
    namespace cannot tell a filtering control plane from a one-namespace mesh.)"""
    seen = sorted(set().union(*namespaces)) if namespaces else []
    if len(seen) < 2 or any(len(answer) > 1 for answer in namespaces):
        return []
    return [
        f"Proxies from {len(seen)} namespace(s) ({', '.join(seen) or 'none'}) through {len(namespaces)} "
        "agent(s): each agent's control plane answered only about the agent's own namespace (istiod 1.28 "
        "and later filter debug answers by the asking workload's namespace), so proxies in namespaces "
        "without an agent asked are missing."
    ]
