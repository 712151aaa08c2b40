"""The mesh file schema: a full example, defaults, and one precise error per kind of mistake."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from istio_agent.controlplane.mesh import (
    MeshConfig,
    MeshError,
    NameEntry,
    OutboundBinding,
    Service,
    Workload,
    load_mesh,
    parse_mesh,
)

SOURCE = Path("mesh.yaml")

FULL = """
trustDomain: example.org
domainSuffix: corp.local
services:
  - name: a
    port: 8000
  - name: b
    namespace: shop
    port: 9000
    protocol: HTTP
    addresses: [10.96.0.20, "fd00::0:20"]
  - name: db
    port: 5432
    protocol: Tcp
workloads:
  - name: a-1
    serviceAccount: sa-a
    address: 127.0.0.2
    labels: {app: a, version: "1"}
    services: [a]
    inboundPort: 15105
    appPort: 18070
    outbound:
      - service: b.shop
        port: 15201
      - service: db
        port: 15202
  - name: b-1.pod
    namespace: shop
    services: [b, db.default]
    inboundPort: 15106
    appPort: 18080
nameTable:
  db.example.com: {ips: [10.0.0.5], registry: External, shortname: db, namespace: ext, altHosts: [db]}
  "*.wild.example.com": {ips: ["::1"]}
"""


def parse(text: str) -> MeshConfig:
    return parse_mesh(text, SOURCE)


def reason(document: object) -> str:
    """The MeshError reason for ``document`` (a dict/list rendered as YAML)."""
    with pytest.raises(MeshError) as caught:
        parse(yaml.safe_dump(document))
    assert str(caught.value) == f"mesh file {SOURCE}: {caught.value.reason}"
    return caught.value.reason


def test_full_example() -> None:
    mesh = parse(FULL)
    assert mesh.trust_domain == "example.org"
    assert mesh.domain_suffix == "corp.local"
    assert mesh.raw["services"][0] == {"name": "a", "port": 8000}
    assert mesh.services == (
        Service("a", "default", 8000, "http", (), "corp.local"),
        Service("b", "shop", 9000, "http", ("10.96.0.20", "fd00::20"), "corp.local"),
        Service("db", "default", 5432, "tcp", (), "corp.local"),
    )
    assert mesh.services[1].hostname == "b.shop.svc.corp.local"
    a1, b1 = mesh.workloads
    assert a1 == Workload(
        name="a-1",
        namespace="default",
        service_account="sa-a",
        address="127.0.0.2",
        labels={"app": "a", "version": "1"},
        services=("a.default",),
        inbound_port=15105,
        app_port=18070,
        outbound=(OutboundBinding("b.shop", 15201), OutboundBinding("db.default", 15202)),
    )
    assert a1.spiffe_id(mesh.trust_domain) == "spiffe://example.org/ns/default/sa/sa-a"
    assert b1.name == "b-1.pod"
    assert b1.services == ("b.shop", "db.default")
    assert b1.spiffe_id("td") == "spiffe://td/ns/shop/sa/default"
    assert mesh.name_table == {
        "*.wild.example.com": NameEntry(ips=("::1",)),
        "db.example.com": NameEntry(("10.0.0.5",), "External", "db", "ext", ("db",)),
    }


def test_lookups() -> None:
    mesh = parse(FULL)
    assert mesh.service("b", "shop") is mesh.services[1]
    assert mesh.service("b.shop", "default") is mesh.services[1]
    assert mesh.service("b", "default") is None
    assert mesh.service("zz.shop", "shop") is None
    assert mesh.workload("b-1.pod", "shop") is mesh.workloads[1]
    assert mesh.workload("b-1.pod", "default") is None
    assert mesh.backing_workloads(mesh.services[2]) == (mesh.workloads[1],)


def test_defaults() -> None:
    mesh = parse(
        "services: [{name: s, port: 80}]\nworkloads: [{name: w}, {name: v, services: [s], inboundPort: 1, appPort: 2}]"
    )
    assert mesh.trust_domain == "cluster.local"
    assert mesh.domain_suffix == "cluster.local"
    assert mesh.services == (Service("s", "default", 80, "http", ()),)
    assert mesh.services[0].hostname == "s.default.svc.cluster.local"
    assert mesh.workloads[0] == Workload("w", "default", "default", "127.0.0.1", {}, (), None, None, ())
    assert mesh.name_table == {}
    empty = parse("{}")
    assert (empty.services, empty.workloads, empty.name_table) == ((), (), {})
    assert parse("services:\nworkloads:\nnameTable:\n").services == ()


def test_existing_api_still_works(tmp_path: Path) -> None:
    path = tmp_path / "mesh.yaml"
    path.write_text("trustDomain: example.org\nservices: []\nnameTable: {}\n")
    mesh = load_mesh(path)
    assert mesh == MeshConfig(
        trust_domain="example.org", raw={"trustDomain": "example.org", "services": [], "nameTable": {}}
    )
    with pytest.raises(MeshError, match="is not a valid trust domain"):
        parse("trustDomain: 'Not A Domain'")


def svc(**fields: object) -> dict[str, object]:
    return {"name": "b", "port": 8000, **fields}


def wl(**fields: object) -> dict[str, object]:
    return {"name": "a", "services": ["b"], "inboundPort": 15106, "appPort": 18080, **fields}


SERVICES = [svc(), svc(name="c", protocol="tcp")]
GRPC_SERVICES = [svc(), svc(name="g", port=7070, protocol="grpc")]


def pl(**fields: object) -> dict[str, object]:
    """A proxyless gRPC workload backing g."""
    return {"name": "g-1", "proxyless": True, "services": ["g"], "appPort": 17070, **fields}


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        # services
        ({"services": [svc(), svc(name="c"), svc(port=70000)]},
         "services[2] (b.default).port: must be between 1 and 65535, got 70000"),
        ({"services": [svc(port=0)]}, "services[0] (b.default).port: must be between 1 and 65535, got 0"),
        ({"services": [svc(port="80")]}, "services[0] (b.default).port: expected an integer, got a string"),
        ({"services": [svc(port=True)]}, "services[0] (b.default).port: expected an integer, got a boolean"),
        ({"services": [{"name": "b"}]}, 'services[0] (b.default): missing required key "port"'),
        ({"services": [{"port": 80}]}, 'services[0]: missing required key "name"'),
        ({"services": [svc(name="B_x")]}, "services[0]: name 'B_x' is not a valid DNS-1123 label"),
        ({"services": [svc(namespace="a.b")]},
         "services[0]: namespace 'a.b' is not a valid namespace (DNS-1123 label)"),
        ({"services": [svc(protocol="udp")]},
         "services[0] (b.default): protocol 'udp' is not one of http, grpc, tcp"),
        ({"services": [svc(addresses=["10.0.0.1", "10.0.0.300"])]},
         'services[0] (b.default): addresses[1] "10.0.0.300" is not an IP address'),
        ({"services": [svc(addresses="10.0.0.1")]},
         "services[0] (b.default).addresses: expected a list, got a string"),
        ({"services": [svc(), svc(namespace="default", port=9000)]},
         "services[1] (b.default): duplicate service b.default.svc.cluster.local (also services[0])"),
        ({"services": [svc(prot="tcp")]},
         'services[0]: unknown key "prot" (known: name, namespace, port, protocol, addresses)'),
        ({"services": [svc(x=1, prot="tcp")]}, 'services[0]: unknown keys "prot", "x"'),
        ({"services": ["b"]}, "services[0]: expected a map, got a string"),
        ({"services": {"b": {}}}, "services: expected a list, got a map"),
        # workloads
        ({"services": SERVICES, "workloads": [wl(outbound=[{"service": "c", "port": 1}, {"service": "zz", "port": 2}])]},
         'workloads[0] (a.default): outbound[1] refers to unknown service "zz.default"'),
        ({"services": SERVICES, "workloads": [wl(outbound=[{"service": "c.other", "port": 1}])]},
         'workloads[0] (a.default): outbound[0] refers to unknown service "c.other"'),
        ({"services": SERVICES, "workloads": [wl(services=["b", "zz.ns"])]},
         'workloads[0] (a.default): services[1] refers to unknown service "zz.ns"'),
        ({"services": SERVICES, "workloads": [wl(services=["b", "b.default"])]},
         'workloads[0] (a.default): services[1] lists "b.default" again'),
        ({"services": SERVICES, "workloads": [wl(), wl(namespace="default")]},
         "workloads[1] (a.default): duplicate workload (also workloads[0])"),
        ({"services": SERVICES,
          "workloads": [wl(outbound=[{"service": "b", "port": 15201}, {"service": "c", "port": 15201}])]},
         "workloads[0] (a.default): outbound[1] port 15201 is already used by outbound[0]"),
        ({"services": SERVICES, "workloads": [wl(outbound=[{"service": "c", "port": 15106}])]},
         "workloads[0] (a.default): outbound[0] port 15106 is the workload's inboundPort"),
        ({"services": SERVICES, "workloads": [wl(outbound=[{"service": "c", "port": 18080}])]},
         "workloads[0] (a.default): outbound[0] port 18080 is the workload's appPort"),
        ({"services": SERVICES, "workloads": [wl(outbound=[{"service": "c", "port": 99999}])]},
         "workloads[0] (a.default).outbound[0].port: must be between 1 and 65535, got 99999"),
        ({"services": SERVICES, "workloads": [wl(outbound=[{"service": "c", "prt": 1}])]},
         'workloads[0] (a.default).outbound[0]: unknown key "prt" (known: service, port)'),
        ({"services": SERVICES, "workloads": [wl(outbound=[{"port": 1}])]},
         'workloads[0] (a.default).outbound[0]: missing required key "service"'),
        ({"services": SERVICES, "workloads": [wl(inboundPort=None)]},
         "workloads[0] (a.default): backs services but has no inboundPort (where its Envoy accepts mesh traffic)"),
        ({"services": SERVICES, "workloads": [wl(appPort=None)]},
         "workloads[0] (a.default): backs services but has no appPort (where its application listens)"),
        ({"services": SERVICES, "workloads": [wl(appPort=15106)]},
         "workloads[0] (a.default): inboundPort and appPort are both 15106"),
        ({"services": SERVICES, "workloads": [wl(address="localhost")]},
         'workloads[0] (a.default): address "localhost" is not an IP address'),
        ({"services": SERVICES, "workloads": [wl(labels={"version": 1})]},
         "workloads[0] (a.default).labels.version: expected a string, got an integer (quote it)"),
        ({"services": SERVICES, "workloads": [wl(labels=["app"])]},
         "workloads[0] (a.default).labels: expected a map, got a list"),
        ({"services": SERVICES, "workloads": [wl(serviceAcount="x")]},
         'workloads[0]: unknown key "serviceAcount"'),
        ({"services": SERVICES, "workloads": [wl(serviceAccount="Bad Account")]},
         "workloads[0] (a.default): serviceAccount 'Bad Account' is not a valid service account (DNS-1123 subdomain)"),
        ({"services": SERVICES, "workloads": [wl(services="b")]},
         "workloads[0] (a.default).services: expected a list, got a string"),
        # proxyless workloads
        ({"services": GRPC_SERVICES, "workloads": [pl(inboundPort=15106)]},
         "workloads[0] (g-1.default): is proxyless (no Envoy) but has an inboundPort: its gRPC server listens on appPort"),
        ({"services": GRPC_SERVICES, "workloads": [pl(outbound=[{"service": "g", "port": 15201}])]},
         "workloads[0] (g-1.default): is proxyless but has outbound bindings: a proxyless client dials xds:///<host>:<port>"),
        ({"services": GRPC_SERVICES, "workloads": [pl(appPort=None)]},
         "workloads[0] (g-1.default): backs services but has no appPort (where its xDS gRPC server listens)"),
        ({"services": GRPC_SERVICES, "workloads": [pl(services=["b"])]},
         'workloads[0] (g-1.default): is proxyless but backs "b.default", whose protocol is http, not grpc'),
        ({"services": GRPC_SERVICES, "workloads": [pl(proxyless="yes")]},
         "workloads[0] (g-1.default).proxyless: expected true or false, got a string"),
        # captured workloads
        ({"services": GRPC_SERVICES, "workloads": [pl(capture=True)]},
         "workloads[0] (g-1.default): captures traffic (capture: true) but is proxyless: there is no Envoy to capture to"),
        ({"services": SERVICES, "workloads": [wl(capture=True, outbound=[{"service": "c", "port": 15201}])]},
         "workloads[0] (a.default): captures traffic (capture: true) and has outbound bindings: "
         "a captured workload reaches services by name or address"),
        ({"services": SERVICES, "workloads": [wl(capture="yes")]},
         "workloads[0] (a.default).capture: expected true or false, got a string"),
        # top level and name table
        ({"trustDomian": "x"}, 'unknown key "trustDomian"'),
        ({"domainSuffix": "Not_A.domain"}, "domainSuffix 'Not_A.domain' is not a valid DNS domain"),
        ({"nameTable": []}, "nameTable: expected a map, got a list"),
        ({"nameTable": {"bad host": {"ips": ["10.0.0.1"]}}},
         "nameTable key 'bad host' is not a valid host name"),
        ({"nameTable": {"db.example.com": {"ips": ["nope"]}}},
         'nameTable["db.example.com"]: ips[0] "nope" is not an IP address'),
        ({"nameTable": {"db.example.com": {"ip": ["10.0.0.1"]}}},
         'nameTable["db.example.com"]: unknown key "ip"'),
        ({"nameTable": {"db.example.com": {"registry": 5}}},
         'nameTable["db.example.com"].registry: expected a string, got an integer'),
        ({"nameTable": {"db.example.com": None}}, 'nameTable["db.example.com"]: expected a map, got null'),
    ],
)  # fmt: skip
def test_validation_errors(document: object, expected: str) -> None:
    assert reason(document).startswith(expected)


def test_protocol_is_case_insensitive_and_ips_are_canonical() -> None:
    mesh = parse(yaml.safe_dump({"services": [svc(protocol="TCP", addresses=["FD00:0::1"])]}))
    assert mesh.services[0].protocol == "tcp"
    assert mesh.services[0].addresses == ("fd00::1",)


def test_workload_in_other_namespace_refers_to_services_by_namespace() -> None:
    document = {
        "services": [svc(namespace="shop")],
        "workloads": [{"name": "x", "namespace": "shop", "outbound": [{"service": "b", "port": 1}]}],
    }
    assert parse(yaml.safe_dump(document)).workloads[0].outbound == (OutboundBinding("b.shop", 1),)
    document["workloads"] = [{"name": "x", "outbound": [{"service": "b", "port": 1}]}]
    assert reason(document) == 'workloads[0] (x.default): outbound[0] refers to unknown service "b.default"'


# -- fuzz: any document is a MeshConfig or a MeshError, never a crash -------------------------------

_KEYS = st.sampled_from(
    ["name", "namespace", "port", "protocol", "addresses", "service", "services", "workloads", "outbound",
     "inboundPort", "appPort", "address", "labels", "serviceAccount", "nameTable", "ips", "altHosts", "b", "x"]
)  # fmt: skip
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 70000),
    st.floats(allow_nan=False),
    st.sampled_from(["b", "c", "b.default", "tcp", "HTTP", "10.0.0.1", "::1", "", "Bad Name", "a.b.c"]),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_KEYS, inner, max_size=4)),
    max_leaves=20,
)
_DOCUMENTS = st.fixed_dictionaries(
    {},
    optional={
        "services": st.one_of(_VALUES, st.lists(st.dictionaries(_KEYS, _VALUES, max_size=5), max_size=3)),
        "workloads": st.one_of(_VALUES, st.lists(st.dictionaries(_KEYS, _VALUES, max_size=6), max_size=3)),
        "nameTable": st.one_of(
            _VALUES, st.dictionaries(st.sampled_from(["h.example", "*.w", "bad host"]), _VALUES)
        ),
        "domainSuffix": _VALUES,
    },
)


@settings(max_examples=300, deadline=None)
@given(_DOCUMENTS)
def test_any_document_parses_or_fails_cleanly(document: dict[str, object]) -> None:
    try:
        parse(yaml.safe_dump(document))
    except MeshError as err:
        assert err.reason


def test_documented_example_is_valid() -> None:
    """docs/controlplane.md's mesh-file example parses (the docs cannot drift from the schema)."""
    docs = Path(__file__).resolve().parents[2] / "docs" / "controlplane.md"
    section = docs.read_text().split("## Mesh file", 1)[1]
    example = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    mesh = parse(example)
    assert [s.hostname for s in mesh.services] == [
        "b.default.svc.cluster.local",
        "db.default.svc.cluster.local",
        "echo.default.svc.cluster.local",
    ]
    assert mesh.workload("a-1", "default") is not None
    proxyless = mesh.workload("echo-1", "default")
    assert proxyless is not None and proxyless.proxyless and proxyless.endpoint_port == 17070
    assert "db.example.com" in mesh.name_table


def test_proxyless_workload_is_reached_on_its_app_port() -> None:
    mesh = parse_mesh(
        yaml.safe_dump({"services": GRPC_SERVICES, "workloads": [pl(), wl(name="e", services=["b"])]}),
        Path("mesh.yaml"),
    )
    proxyless, sidecar = mesh.workloads
    assert (proxyless.proxyless, proxyless.inbound_port, proxyless.endpoint_port) == (True, None, 17070)
    assert (sidecar.proxyless, sidecar.endpoint_port) == (False, 15106)
    grpc_service = mesh.service("g", "default")
    assert grpc_service is not None and grpc_service.is_http and grpc_service.protocol == "grpc"
