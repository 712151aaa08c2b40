"""``agentctl proxy-status PROXY``: istioctl's comparator (``istioctl/pkg/writer/compare`` at Istio
ff49c188) against its own test data, the unified diff against go-difflib's examples, and what is
normalised before comparing (versions, update times, draining listeners, orders)."""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from envoy.admin.v3 import config_dump_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import json_format

from istio_agent.ctl import proxydiff as pd
from istio_agent.ctl.configdump.source import Dump
from istio_agent.ctl.proxystatus import ProxyStatusError

COMPARE = Path(__file__).parent / "testdata" / "istioctl" / "compare"
SAME = (COMPARE / "configdump.json").read_bytes()
DIFFERENT = (COMPARE / "configdump_diff.json").read_bytes()


@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Local time is UTC (istioctl prints the RDS time in the local zone)."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def dump(document: dict[str, Any]) -> Dump:
    return Dump(copy.deepcopy(document))


def response_of(data: bytes) -> dict[str, discovery_pb2.DiscoveryResponse]:
    """istiod's answer holding ``data``'s sections as binary Anys (what the control plane sends)."""
    config = config_dump_pb2.ConfigDump()
    json_format.Parse(data, config, ignore_unknown_fields=True)
    return {"istiod-1": discovery_pb2.DiscoveryResponse(resources=list(config.configs))}


# -- go-difflib (github.com/pmezard/go-difflib 5d4384ee4fb2, the version Istio 1.28's go.mod pins) ---------


def test_split_lines_is_go_difflibs_every_line_ends_in_a_newline() -> None:
    assert pd.split_lines("foo") == ["foo\n"]
    assert pd.split_lines("foo\nbar") == ["foo\n", "bar\n"]
    assert pd.split_lines("foo\nbar\n") == ["foo\n", "bar\n", "\n"]


def test_unified_diff_is_go_difflibs_example() -> None:
    """``ExampleGetUnifiedDiffCode`` in go-difflib's difflib_test.go (without the dates)."""
    a = 'one\ntwo\nthree\nfour\nfmt.Printf("%s,%T",a,b)'
    b = "zero\none\nthree\nfour"
    expected = (
        "--- Original\n+++ Current\n@@ -1,5 +1,4 @@\n+zero\n one\n-two\n three\n four\n"
        '-fmt.Printf("%s,%T",a,b)\n'
    )
    assert pd.unified_diff(a, b, "Original", "Current", 3) == expected
    assert pd.unified_diff(a, a, "Original", "Current", 3) == ""


def test_unified_diff_hunks_and_context_as_go_difflibs_grouped_opcodes() -> None:
    """``TestGroupedOpCodes``'s sequences and its three groups (e 5-8/5-8 ... e 16-19/17-20 ... e 35-38/31-34)
    as unified hunks with three lines of context."""
    a = [f"{i:02d}" for i in range(39)]
    b = [*a[:8], " i", *a[8:19], " x", *a[20:22], *a[27:34], " y", *a[35:]]
    text = pd.unified_diff("\n".join(a), "\n".join(b), "A", "B", 3)
    assert re.findall(r"^@@ .* @@$", text, re.M) == [
        "@@ -6,6 +6,7 @@",
        "@@ -17,14 +18,9 @@",
        "@@ -32,7 +28,7 @@",
    ]


# -- istioctl's comparator test data ------------------------------------------------------------------


def test_the_same_dump_matches_as_istioctls_test(utc: None) -> None:
    """``TestComparatorMatchingSameConfigs``; the RDS time is the dump's route last_updated."""
    document = json.loads(SAME)
    result = pd.compare(dump(document), dump(document))
    assert result.error is None
    assert result.stdout == (
        "Clusters Match\nListeners Match\nRoutes Match (RDS last loaded at Mon, 04 Mar 2024 08:37:44 UTC)\n"
    )


def test_the_rds_time_is_in_the_local_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    try:
        out = pd.compare(Dump.from_bytes(SAME), Dump.from_bytes(SAME)).stdout
    finally:
        monkeypatch.undo()
        time.tzset()
    assert out.endswith("Routes Match (RDS last loaded at Mon, 04 Mar 2024 14:07:44 IST)\n")


def test_different_dumps_do_not_match_as_istioctls_test(utc: None) -> None:
    """``TestComparatorMismatchedConfigs``: each section prints its unified diff, then a blank line."""
    result = pd.compare(Dump.from_bytes(SAME), Dump.from_bytes(DIFFERENT))
    assert result.error is None
    out = result.stdout
    clusters, rest = out.split("Listeners Don't Match\n", 1)
    listeners, routes = rest.split("Routes Don't Match (RDS last loaded at ", 1)
    assert clusters.startswith("Clusters Don't Match\n--- Istiod Clusters\n+++ Envoy Clusters\n@@ -")
    assert listeners.startswith("--- Istiod Listeners\n+++ Envoy Listeners\n@@ -")
    assert routes.startswith("Mon, 04 Mar 2024 08:37:44 UTC)\n--- Istiod Routes\n+++ Envoy Routes\n@@ -")
    for section in (clusters, listeners, routes):
        assert section.endswith("\n\n")  # Fprintln of a diff that ends in a newline
    # jsonpb's text (four-space indent, JSON names) of the cluster whose name and EDS config changed
    assert '-                "name": "inbound-vip|9080|http|ratings.default.svc.cluster.local",\n' in clusters
    assert '+                "name": "inbound-vip|9999|http|ratings.default.svc.cluster.local",\n' in clusters
    assert '-                "edsClusterConfig": {\n' in clusters
    assert re.search(r'^- +"useRemoteAddress": false,$', listeners, re.M)
    # istioctl's seven lines of context: around the one line dropped from the listener
    hunk = listeners.split("@@\n", 1)[1].split("\n@@ ", 1)[0].splitlines()
    assert [line[:1] for line in hunk] == [" "] * 7 + ["-"] + [" "] * 7
    assert '-                                        "statPrefix": "inbound_0.0.0.0_9080",\n' in listeners


def test_the_diff_turns_istiods_text_into_envoys(utc: None) -> None:
    """Applying each printed diff to istiod's side gives Envoy's side (seven lines of context)."""
    istiod, envoy = Dump.from_bytes(SAME), Dump.from_bytes(DIFFERENT)
    for kind in ("clusters", "listeners", "routes"):
        a, b = pd.section_text(kind, istiod), pd.section_text(kind, envoy)
        text = pd.unified_diff(a, b, "x", "y")
        assert apply(pd.split_lines(a), text) == pd.split_lines(b)
        contexts = re.findall(r"^@@ -(\d+)", text, re.M)
        assert contexts and all(int(start) >= 1 for start in contexts)


def apply(lines: list[str], diff: str) -> list[str]:
    out: list[str] = []
    at = 0
    for hunk in re.split(r"^(?=@@ )", diff, flags=re.M)[1:]:
        head, *body = hunk.splitlines(keepends=True)
        start = int(re.match(r"@@ -(\d+)", head).group(1))  # type: ignore[union-attr]
        begin = start - 1 if not re.match(r"@@ -\d+,0 ", head) else start
        out += lines[at:begin]
        at = begin
        for line in body:
            if line[0] == " ":
                assert lines[at] == line[1:]
                out.append(line[1:])
                at += 1
            elif line[0] == "-":
                assert lines[at] == line[1:]
                at += 1
            else:
                out.append(line[1:])
    return out + lines[at:]


def test_istiods_binary_sections_print_as_envoys_json(utc: None) -> None:
    """The control plane's answer (binary Anys) and Envoy's JSON of the same config print the same."""
    result = pd.compare(pd.istiod_dump(response_of(SAME)), Dump.from_bytes(SAME))
    assert result.stdout.splitlines()[:2] == ["Clusters Match", "Listeners Match"]
    assert result.stdout.splitlines()[2].startswith("Routes Match (RDS last loaded at ")


def test_no_dump_from_istiod_is_istioctls_error() -> None:
    with pytest.raises(ProxyStatusError, match=r"^unable to find config dump in Istiod responses$"):
        pd.istiod_dump({"istiod-1": discovery_pb2.DiscoveryResponse()})
    with pytest.raises(ProxyStatusError, match=r"^unable to find config dump in Istiod responses$"):
        pd.istiod_dump({})


# -- what is normalised before comparing --------------------------------------------------------------


def test_versions_times_names_draining_and_orders_are_not_compared(utc: None) -> None:
    document = json.loads(SAME)
    other = copy.deepcopy(document)
    clusters, listeners, routes = (other["configs"][i] for i in range(3))
    for entry in clusters["dynamic_active_clusters"]:
        entry["version_info"], entry["last_updated"] = "v9", "2030-01-01T00:00:00Z"
    listeners["dynamic_listeners"].reverse()
    for entry in listeners["dynamic_listeners"]:
        entry["name"] = "renamed"
        entry["active_state"]["version_info"] = "v9"
        entry["active_state"]["last_updated"] = "2030-01-01T00:00:00Z"
        entry["draining_state"] = copy.deepcopy(entry["active_state"])
    listeners["dynamic_listeners"].append({"name": "gone", "draining_state": {"version_info": "v1"}})
    route = routes["dynamic_route_configs"][0]
    route["version_info"] = "v9"
    hosts = route["route_config"]["virtual_hosts"]
    hosts.insert(0, {"name": "zzz", "domains": ["*"]})
    document["configs"][2]["dynamic_route_configs"][0]["route_config"]["virtual_hosts"].append(
        {"name": "zzz", "domains": ["*"]}
    )
    result = pd.compare(dump(document), dump(other))
    assert result.stdout.splitlines()[:3] == [
        "Clusters Match",
        "Listeners Match",
        "Routes Match (RDS last loaded at Mon, 04 Mar 2024 08:37:44 UTC)",
    ]


def test_a_cluster_missing_from_envoy_is_a_diff_of_its_lines(utc: None) -> None:
    document = json.loads(SAME)
    fewer = copy.deepcopy(document)
    fewer["configs"][0]["dynamic_active_clusters"] = []
    out = pd.compare(dump(document), dump(fewer)).stdout
    lines = out.splitlines()
    assert lines[:3] == ["Clusters Don't Match", "--- Istiod Clusters", "+++ Envoy Clusters"]
    # Envoy's side is jsonpb's empty message, "{", "", "}": all three lines are in istiod's text too
    # (an empty message inside it, such as "ads", prints an empty line)
    istiod_lines = pd.split_lines(pd.section_text("clusters", dump(document)))
    assert lines[3] == f"@@ -1,{len(istiod_lines)} +1,3 @@"
    assert lines[4:6] == [" {", '-    "dynamicActiveClusters": [']
    hunk = lines[4 : lines.index("Listeners Match")]
    assert sum(line.startswith("-") for line in hunk) == len(istiod_lines) - 3
    assert not any(line.startswith("+") for line in hunk)
    assert "Listeners Match" in lines


def test_a_section_envoy_lacks_is_compared_as_istioctls_error_text(utc: None) -> None:
    document = json.loads(SAME)
    no_clusters = {"configs": document["configs"][1:]}
    out = pd.compare(dump(document), dump(no_clusters)).stdout
    assert (
        "+config dump has no configuration type type.googleapis.com/envoy.admin.v3.ClustersConfigDump\n"
        in out
    )


def test_routes_section_missing_from_envoy_is_an_error_after_the_other_sections(utc: None) -> None:
    """istioctl returns the RDS time's error: clusters and listeners are printed, then the error."""
    document = json.loads(SAME)
    no_routes = {"configs": document["configs"][:2]}
    result = pd.compare(dump(document), dump(no_routes))
    assert result.stdout == "Clusters Match\nListeners Match\n"
    assert result.error == (
        "config dump has no configuration type type.googleapis.com/envoy.admin.v3.RoutesConfigDump"
    )


def test_routes_without_a_time_say_no_time(utc: None) -> None:
    document = json.loads(SAME)
    del document["configs"][2]["dynamic_route_configs"][0]["last_updated"]
    assert pd.compare(dump(document), dump(document)).stdout.endswith("\nRoutes Match\n")


# -- the proxy's name -----------------------------------------------------------------------------------


def test_proxy_name_is_pod_dot_namespace_as_istioctl_infers_it() -> None:
    assert pd.pod_and_namespace("a", "default") == ("a", "default")
    assert pd.pod_and_namespace("a.foo", "default") == ("a", "foo")
    assert pd.pod_and_namespace("a.b.foo", "default") == ("a.b", "foo")
    assert pd.pod_and_namespace("pod/a.foo", "default") == ("a", "foo")
    assert pd.pod_and_namespace("pod/a", "bar") == ("a", "bar")
    with pytest.raises(ProxyStatusError, match="deployment/x"):
        pd.pod_and_namespace("deployment/x.foo", "default")


def test_a_ztunnel_dump_has_no_sync_diff() -> None:
    ztunnel = json.dumps({"workloads": [], "services": [], "certificates": []}).encode()
    assert pd.is_ztunnel_dump(ztunnel)
    assert not pd.is_ztunnel_dump(SAME)


async def test_a_ztunnels_dump_says_so_without_asking_the_control_plane(tmp_path: Path) -> None:
    saved = tmp_path / "ztunnel.json"
    saved.write_text(json.dumps({"workloads": [], "services": [], "policies": [], "certificates": []}))
    report = await pd.run(pd.DiffOptions(proxy="ztunnel-x.istio-system", file=str(saved)))
    assert report.stdout == "Sync diff is not available for ztunnel pod ztunnel-x.istio-system\n"


async def test_envoys_dump_is_read_first_and_its_failure_is_istioctls_error(tmp_path: Path) -> None:
    missing = tmp_path / "missing.json"
    with pytest.raises(ProxyStatusError, match=rf"^could not contact sidecar: open {missing}: no such file"):
        await pd.run(pd.DiffOptions(proxy="a", file=str(missing)))


def test_istiods_unknown_any_types_read_as_their_type_url(utc: None) -> None:
    """istioctl's comparator resolves types non-strictly (Istio's own extensions are unknown to it)."""
    from envoy.config.listener.v3 import listener_pb2
    from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm
    from google.protobuf import any_pb2

    stats = any_pb2.Any(type_url="type.googleapis.com/stats.PluginConfig", value=b"\x0a\x03abc\xff")
    manager = hcm.HttpConnectionManager(stat_prefix="s")
    manager.http_filters.add(name="istio.stats", typed_config=stats)
    listener = listener_pb2.Listener(name="l")
    listener.listener_filters.add(name="x", typed_config=stats)
    listener.filter_chains.add().filters.add(
        name="envoy.filters.network.http_connection_manager"
    ).typed_config.Pack(manager)
    from envoy.admin.v3 import config_dump_shared_pb2

    section = config_dump_shared_pb2.ListenersConfigDump()
    section.dynamic_listeners.add(name="l").active_state.listener.Pack(listener)
    clusters = any_pb2.Any(type_url="type.googleapis.com/stats.PluginConfig", value=b"\x01")
    packed = any_pb2.Any()
    packed.Pack(section)
    istiod = pd.istiod_dump({"istiod-1": discovery_pb2.DiscoveryResponse(resources=[packed, clusters])})
    text = pd.section_text("listeners", istiod)
    assert text.count('"@type": "type.googleapis.com/stats.PluginConfig"') == 2, text
    assert '"name": "istio.stats"' in text
    assert istiod.configs[1] == {"@type": "type.googleapis.com/stats.PluginConfig"}
