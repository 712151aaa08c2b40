"""``agentctl proxy-status``'s rendering against istioctl's format, asking agents concurrently, and
peers on loopback whose answer does not decode."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
import yaml
from envoy.config.core.v3.base_pb2 import ControlPlane
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.status.v3 import csds_pb2
from google.protobuf import any_pb2

from istio_agent.ctl import proxystatus as ps
from istio_agent.xds.flavour import ADS_SERVICE, SOTW

CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
RDS = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
NDS = "type.googleapis.com/istio.networking.nds.v1.NameTable"
NOW = 1_800_000_000.0
S = csds_pb2.ConfigStatus


def client_config(
    proxy_id: str,
    types: dict[str, tuple[int, float | None, str | None]],
    *,
    cluster: str = "Kubernetes",
    version: str = "1.31.0",
) -> any_pb2.Any:
    config = csds_pb2.ClientConfig()
    config.node.id = proxy_id
    config.node.metadata["CLUSTER_ID"] = cluster
    config.node.metadata["NAMESPACE"] = proxy_id.rpartition(".")[2]
    config.node.metadata["ISTIO_VERSION"] = version
    for type_url, (status, age, error) in sorted(types.items()):
        entry = config.generic_xds_configs.add(type_url=type_url, config_status=status)
        if age is not None:
            entry.last_updated.FromNanoseconds(int((NOW - age) * 1e9))
        if error is not None:
            entry.error_state.details = error
    packed = any_pb2.Any()
    packed.Pack(config)
    return packed


def syncz(istiod: str, *configs: any_pb2.Any) -> discovery_pb2.DiscoveryResponse:
    identifier = json.dumps({"Component": "istiod", "ID": istiod, "Info": {"version": "1.31.0"}})
    return discovery_pb2.DiscoveryResponse(
        type_url=ps.SYNCZ_TYPE, resources=list(configs), control_plane=ControlPlane(identifier=identifier)
    )


def sample() -> dict[str, discovery_pb2.DiscoveryResponse]:
    core = {CDS: (S.SYNCED, 40.0, None), LDS: (S.SYNCED, 40.0, None), EDS: (S.SYNCED, 3.0, None)}
    return {
        "istiod-1": syncz(
            "istiod-1",
            client_config(
                "web-1.default", {**core, RDS: (S.SYNCED, 40.0, None), NDS: (S.SYNCED, 40.0, None)}
            ),
            client_config(
                "bookinfo-gateway-istio-cf89b9c8f-f5p77.istio-system",
                {**core, LDS: (S.ERROR, 200.0, "listener 0.0.0.0_80: duplicate")},
                version="1.22.3",
            ),
            client_config("db-0.data", {CDS: (S.NOT_SENT, None, None), RDS: (S.UNKNOWN, None, None)}),
        )
    }


ISTIOCTL_TABLE = """\
NAME                                                  CLUSTER        ISTIOD                      VERSION     SUBSCRIBED TYPES
bookinfo-gateway-istio-cf89b9c8f-f5p77.default        Kubernetes     istiod-7d4f74889d-mb5dh     1.27.1      4 (CDS,LDS,EDS,RDS)
details-v1-55cddc9798-2mdwz.bookinfo                  Kubernetes     istiod-7d4f74889d-mb5dh     1.27.1      4 (CDS,LDS,EDS,RDS)
details-v1-684d4f87d4-89q6q.default                   Kubernetes     istiod-7d4f74889d-mb5dh     1.22.3      4 (CDS,LDS,EDS,RDS)
istio-ingressgateway-b6cd68585-8mnj7.istio-system     Kubernetes     istiod-7d4f74889d-mb5dh     1.27.1      4 (CDS,LDS,EDS,RDS)
"""  # noqa: E501
"""What istioctl 1.27 prints for such a mesh (Go's tabwriter: padding 5, the last column unpadded)."""


def test_table_is_istioctls() -> None:
    synced = (S.SYNCED, 40.0, None)
    every = {CDS: synced, LDS: synced, EDS: synced, RDS: synced}
    pods = [
        ("istio-ingressgateway-b6cd68585-8mnj7.istio-system", "1.27.1"),
        ("details-v1-684d4f87d4-89q6q.default", "1.22.3"),
        ("bookinfo-gateway-istio-cf89b9c8f-f5p77.default", "1.27.1"),
        ("details-v1-55cddc9798-2mdwz.bookinfo", "1.27.1"),
    ]
    response = syncz("istiod-7d4f74889d-mb5dh", *(client_config(p, every, version=v) for p, v in pods))
    assert ps.table(ps.proxies({"istiod": response}), verbose=False, now=NOW) == ISTIOCTL_TABLE
    counted = ps.table(ps.proxies(sample()), verbose=False, now=NOW).splitlines()
    assert [line.split()[0] for line in counted[1:]] == [
        "bookinfo-gateway-istio-cf89b9c8f-f5p77.istio-system",
        "db-0.data",
        "web-1.default",
    ]
    assert counted[1].endswith("     1.22.3      3 (CDS,LDS,EDS)")
    assert counted[2].endswith("     1 (CDS)")  # UNKNOWN (IGNORED) types are not counted
    assert counted[3].endswith("     5 (CDS,LDS,EDS,RDS,NDS)")  # core types first, then the rest


def test_verbose_table_has_a_column_per_type_with_ages_and_nacks_go_to_stderr() -> None:
    rows = ps.select(ps.proxies(sample()), None, "web-1") + ps.select(
        ps.proxies(sample()), "istio-system", None
    )
    text = ps.table(rows, verbose=True, now=NOW)
    lines = text.splitlines()
    head = lines[0].split()
    assert head[:3] == ["NAME", "CLUSTER", "CDS"] and head[-2:] == ["ISTIOD", "VERSION"]
    assert head[2:-2] == ["CDS", "ECDS", "EDS", "LDS", "RDS", "NDS"]  # istioctl's five and NDS, by type URL
    assert lines[1].startswith("web-1.default ")
    assert "SYNCED (40s)" in lines[1] and "SYNCED (3s)" in lines[1] and "IGNORED" in lines[1]
    assert "ERROR (3m20s)" in lines[2]
    assert len(lines) == 3  # nothing after the table: scripts parse it
    assert ps.nack_notes(rows, NOW) == [
        "bookinfo-gateway-istio-cf89b9c8f-f5p77.istio-system rejected LDS 3m20s ago: listener 0.0.0.0_80: duplicate"
    ]
    never = ps.table(ps.select(ps.proxies(sample()), "data", None), verbose=True, now=NOW).splitlines()
    assert "NOT SENT" in never[1]


def test_subscribed_types_as_istioctl_names_and_orders_them() -> None:
    synced = (S.SYNCED, 1.0, None)
    wds = "type.googleapis.com/istio.workload.Address"
    wads = "type.googleapis.com/istio.security.Authorization"
    odd = "type.googleapis.com/example.v1.Odd"
    pcds = "type.googleapis.com/istio.mesh.v1alpha1.ProxyConfig"
    types = {t: synced for t in (RDS, CDS, wads, odd, pcds, wds, NDS)}
    (row,) = ps.proxies({"i": syncz("i", client_config("a.default", types))})
    # core types first; then by type URL (example < istio.mesh < istio.networking < istio.security < istio.workload)
    assert ps.subscribed(row) == f"7 (CDS,RDS,{odd},PCDS,NDS,WADS,WDS)"
    (none,) = ps.proxies({"i": syncz("i", client_config("b.default", {CDS: (S.UNKNOWN, None, None)}))})
    assert ps.subscribed(none) == "0"


def test_a_row_whose_last_cell_is_empty_keeps_gos_padding() -> None:
    # no ISTIO_VERSION: the verbose table's last cell is empty, Go's tabwriter pads the one before it
    (row,) = ps.proxies(
        {"i": syncz("istiod-1", client_config("a.default", {CDS: (S.SYNCED, 1.0, None)}, version=""))}
    )
    row = ps.ProxySync(row.proxy_id, row.cluster, row.namespace, row.istiod, "", row.types)
    lines = ps.table([row], verbose=True, now=NOW).splitlines()
    assert lines[1].endswith("istiod-1     ")


def test_empty_result_prints_only_the_header_and_machine_readable_nothing() -> None:
    assert (
        ps.table([], verbose=False, now=NOW)
        == "NAME     CLUSTER     ISTIOD     VERSION     SUBSCRIBED TYPES\n"
    )
    assert ps.machine_readable({}, "json") == ""


def test_json_and_yaml_print_each_discovery_response_with_nack_text_for_alerting() -> None:
    responses = sample()
    responses["istiod-0"] = syncz("istiod-0")
    keep = ps.select(ps.proxies(responses), "istio-system", None)
    text = ps.machine_readable(ps.only(responses, keep), "json")
    decoder = json.JSONDecoder()
    first, end = decoder.raw_decode(text)
    second = json.loads(text[end:])
    assert first["typeUrl"] == ps.SYNCZ_TYPE and "resources" not in first  # istiod-0 first, by ID
    assert text.startswith('{\n    "versionInfo"') or text.startswith('{\n    "typeUrl"')  # four spaces
    (entry,) = second["resources"]
    failed = next(c for c in entry["genericXdsConfigs"] if c["typeUrl"] == LDS)
    assert failed["configStatus"] == "ERROR" and failed["errorState"]["details"].startswith("listener")
    documents = list(yaml.safe_load_all(ps.machine_readable(responses, "yaml").replace("\n{", "\n---\n{")))
    assert documents[0]["typeUrl"] == ps.SYNCZ_TYPE


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (119, "119s"),
        (120, "2m"),
        (200, "3m20s"),
        (600, "10m"),
        (3 * 3600, "3h"),
        (3 * 3600 + 60, "3h1m"),
        (8 * 3600, "8h"),
        (48 * 3600, "2d"),
        (50 * 3600, "2d2h"),
        (400 * 86400, "400d"),
        (-5, "<invalid>"),
    ],
)
def test_ages_are_kubectls(seconds: float, text: str) -> None:
    assert ps.human_duration(seconds) == text


def test_control_plane_id_missing_or_invalid() -> None:
    assert ps.control_plane_info(discovery_pb2.DiscoveryResponse()) == ("MISSING", "")
    bad = discovery_pb2.DiscoveryResponse(control_plane=ControlPlane(identifier="{not json"))
    assert ps.control_plane_info(bad) == ("INVALID", "")


def test_agent_addresses() -> None:
    assert ps.Agent.parse("web-1.default=127.0.0.1:15004") == ps.Agent("127.0.0.1:15004", "web-1.default")
    assert ps.Agent.parse("[::1]:15004") == ps.Agent("[::1]:15004")
    for bad in ("127.0.0.1", "host:0", "host:x", ":15004"):
        with pytest.raises(ValueError, match="not HOST:PORT"):
            ps.Agent.parse(bad)


async def test_agents_asked_concurrently_failures_skipped_and_the_limit_said() -> None:
    agents = [ps.Agent(f"127.0.0.1:{1000 + i}", f"p{i}.default") for i in range(6)]
    running = 0
    most = 0

    async def ask(agent: ps.Agent) -> discovery_pb2.DiscoveryResponse:
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            await asyncio.sleep(0.05)
            if agent.name == "p1.default":
                raise ps.ProxyStatusError("UNAVAILABLE: proxy not connected to Istiod")
            if agent.name == "p2.default":
                await asyncio.sleep(5)  # never answers in time
            # Every agent of one control plane sees every proxy: the list is merged, not repeated.
            return syncz("istiod-1", *(client_config(a.name, {CDS: (S.SYNCED, 1.0, None)}) for a in agents))
        finally:
            running -= 1

    node = ps.debug_node("istio-system", "default")
    result = await ps.via_agents(agents, node, limit=5, timeout=0.5, concurrency=2, ask=ask)
    assert most == 2
    assert result.failures == [
        "Skip the agent in Pod p1.default due to the error: UNAVAILABLE: proxy not connected to Istiod",
        "Skip the agent in Pod p2.default due to the error: no answer within 0.5s",
    ]
    assert result.limited and "hits the limit 5" in ps.limit_message(5)
    assert [row.proxy_id for row in ps.proxies(result.responses)] == sorted(a.name for a in agents)
    assert len(result.responses["istiod-1"].resources) == 6

    unlimited = await ps.via_agents(agents[:1], node, limit=0, ask=ask)
    assert not unlimited.limited and not unlimited.failures


# -- peers whose answer does not decode --------------------------------------------------------------


@contextlib.asynccontextmanager
async def peer(answer: bytes) -> AsyncIterator[str]:
    """A gRPC server on 127.0.0.1 answering every ADS request with ``answer``, sent as raw bytes."""

    async def reply(requests: AsyncIterator[bytes], context: object) -> AsyncIterator[bytes]:
        async for _ in requests:
            yield answer

    async with ads_server(reply) as address:
        yield address


@contextlib.asynccontextmanager
async def ads_server(behaviour: Callable[..., AsyncIterator[bytes]]) -> AsyncIterator[str]:
    """grpcio's server on 127.0.0.1 with ``behaviour`` as its SotW ADS method (bytes in, bytes out)."""
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(behaviour)  # no serializers: bytes go out as they are
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(ADS_SERVICE, {SOTW.method: handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def agentctl(*args: str) -> tuple[int, str, str]:
    """``agentctl proxy-status`` in a process of its own (this loop keeps serving the peers)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "istio_agent.cli.agentctl",
        "proxy-status",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def bad_resource(type_url: str, value: bytes) -> bytes:
    """A well-formed syncz answer holding one resource that is no ClientConfig."""
    response = syncz("istiod-bad", client_config("hidden-1.default", {CDS: (S.SYNCED, 1.0, None)}))
    response.resources.append(any_pb2.Any(type_url=type_url, value=value))
    return response.SerializeToString()


MALFORMED = {
    "garbage": b"\xff\xff\xff\xff",
    "clientconfig-garbage": bad_resource(ps.CLIENT_CONFIG_TYPE, b"\xff\xff\xff\xff"),
    "not-a-clientconfig": bad_resource("type.googleapis.com/example.Unknown", b""),
}


@pytest.mark.parametrize("answer", MALFORMED.values(), ids=MALFORMED.keys())
async def test_an_agent_whose_answer_does_not_decode_is_skipped_and_the_others_listed(answer: bytes) -> None:
    good = syncz("istiod-1", client_config("good-1.default", {CDS: (S.SYNCED, 1.0, None)}))
    async with peer(good.SerializeToString()) as good_address, peer(answer) as bad_address:
        for output in ("table", "json"):
            code, out, err = await agentctl(
                "--xds-via-agents",
                "--agent-address",
                f"good-1.default={good_address}",
                "--agent-address",
                f"bad-1.default={bad_address}",
                "-o",
                output,
            )
            assert code == 0, err
            (line,) = err.splitlines()
            assert line.startswith("Skip the agent in Pod bad-1.default due to the error: malformed answer: ")
            if output == "json":
                answer = json.loads(out)  # the one control plane's DiscoveryResponse, as istioctl prints it
                assert (
                    ps.control_plane_info(
                        discovery_pb2.DiscoveryResponse(
                            control_plane=ControlPlane(identifier=answer["controlPlane"]["identifier"])
                        )
                    )[0]
                    == "istiod-1"
                )
            else:
                assert [row.split()[0] for row in out.splitlines()] == ["NAME", "good-1.default"]


@pytest.mark.parametrize("answer", MALFORMED.values(), ids=MALFORMED.keys())
async def test_a_control_plane_whose_answer_does_not_decode_is_one_error_line(answer: bytes) -> None:
    async with peer(answer) as address:
        code, out, err = await agentctl("--xds-address", address, "--plaintext")
    assert code == 1 and out == ""
    (line,) = err.splitlines()
    assert line.startswith(f"Error: control plane {address}: malformed answer: "), err


def test_a_filtering_control_plane_is_said_when_answers_each_cover_another_namespace() -> None:
    one, other, both = frozenset({"default"}), frozenset({"apps"}), frozenset({"default", "apps"})
    (note,) = ps.partial_view_note([one, other])
    assert note.startswith("Proxies from 2 namespace(s) (apps, default) through 2 agent(s): ")
    assert "missing" in note
    assert ps.partial_view_note([one]) == []  # cannot tell from a one-namespace mesh
    assert ps.partial_view_note([one, one]) == []
    assert ps.partial_view_note([both, one]) == []  # an unfiltered answer: the view is whole
    assert ps.partial_view_note([]) == []


# -- the client agentctl dials with ----------------------------------------------------------------

LOADED_AT_EXIT = """
import atexit, json, sys
atexit.register(lambda: print(json.dumps(sorted(sys.modules)), file=sys.stderr))
sys.argv = ["agentctl", "proxy-status", *sys.argv[1:]]
from istio_agent.cli.agentctl import main
main(prog_name="agentctl")
"""


async def test_proxy_status_asks_on_the_agents_own_grpc_client_and_loads_no_grpcio() -> None:
    good = syncz("istiod-1", client_config("good-1.default", {CDS: (S.SYNCED, 1.0, None)}))
    async with peer(good.SerializeToString()) as address:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            LOADED_AT_EXIT,
            "--xds-via-agents",
            "--agent-address",
            f"good-1.default={address}",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, err.decode()
    assert [row.split()[0] for row in out.decode().splitlines()] == ["NAME", "good-1.default"]
    loaded = json.loads(err.decode().splitlines()[-1])
    assert [name for name in loaded if name == "grpc" or name.startswith("grpc.")] == []
    assert "istio_agent.rpc.channel" in loaded


@contextlib.asynccontextmanager
async def silent_peer() -> AsyncIterator[str]:
    """A gRPC server on 127.0.0.1 that reads ADS requests and never answers."""

    async def never(requests: AsyncIterator[bytes], context: object) -> AsyncIterator[bytes]:
        async for _ in requests:
            await asyncio.sleep(60)
        yield b""  # pragma: no cover

    async with ads_server(never) as address:
        yield address


async def test_agents_that_do_not_answer_in_time_or_refuse_are_skipped_in_istioctls_words() -> None:
    good = syncz("istiod-1", client_config("good-1.default", {CDS: (S.SYNCED, 1.0, None)}))
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        refused = f"127.0.0.1:{unused.getsockname()[1]}"  # bound, not listening: refused
        async with peer(good.SerializeToString()) as good_address, silent_peer() as silent:
            started = time.monotonic()
            code, out, err = await agentctl(
                "--xds-via-agents",
                "--timeout",
                "1s",
                "--agent-address",
                f"good-1.default={good_address}",
                "--agent-address",
                f"slow-1.default={silent}",
                "--agent-address",
                f"gone-1.default={refused}",
            )
            elapsed = time.monotonic() - started
    assert code == 0, err
    assert [row.split()[0] for row in out.splitlines()] == ["NAME", "good-1.default"]
    slow, gone = err.splitlines()
    assert slow == "Skip the agent in Pod slow-1.default due to the error: no answer within 1s"
    assert gone.startswith("Skip the agent in Pod gone-1.default due to the error: UNAVAILABLE: "), gone
    assert "refused" in gone
    assert elapsed < 10


async def test_a_control_plane_error_status_is_its_code_and_details() -> None:
    async def refuse(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for _ in requests:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, ps.AUTHENTICATION_REQUIRED)
        yield b""  # pragma: no cover

    async with ads_server(refuse) as address:
        code, out, err = await agentctl("--xds-address", address, "--plaintext")
    assert code == 1 and out == ""
    (line,) = err.splitlines()
    assert line.startswith(
        f"Error: control plane {address}: UNAUTHENTICATED: authentication required (istiod answers"
    ), line
