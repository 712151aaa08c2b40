"""Reading the type URL of an encoded xDS response without decoding it."""

from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2
from hypothesis import given
from hypothesis import strategies as st

from istio_agent.xds.wire import RawResponse, WireError, string_field

CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"


def _packed(name: str) -> any_pb2.Any:
    resource = any_pb2.Any()
    resource.Pack(cluster_pb2.Cluster(name=name))
    return resource


def test_type_url_of_sotw_and_delta_responses() -> None:
    sotw = discovery_pb2.DiscoveryResponse(
        version_info="v1", type_url=CDS, nonce="n", resources=[_packed(f"c{i}") for i in range(50)]
    )
    raw = RawResponse.decode(sotw.SerializeToString())
    assert raw.type_url == CDS and not raw.malformed
    assert raw.encode() == sotw.SerializeToString()
    delta = discovery_pb2.DeltaDiscoveryResponse(
        type_url=CDS, nonce="n", resources=[discovery_pb2.Resource(name="c", resource=_packed("c"))]
    )
    assert RawResponse.decode(delta.SerializeToString()).type_url == CDS
    assert RawResponse.decode(b"").type_url == ""


def test_malformed_bytes_are_reported_not_raised() -> None:
    good = discovery_pb2.DiscoveryResponse(type_url=CDS, resources=[_packed("c")]).SerializeToString()
    raw = RawResponse.decode(good[:-3])
    assert raw.type_url == "" and raw.malformed


@given(st.binary(max_size=200))
def test_any_bytes_give_a_type_url_or_a_wire_error(data: bytes) -> None:
    try:
        value = string_field(data, 4)
    except WireError:
        return
    assert isinstance(value, str)


@given(st.text(max_size=50), st.text(max_size=20), st.lists(st.text(max_size=10), max_size=5))
def test_matches_the_real_decoder(type_url: str, nonce: str, names: list[str]) -> None:
    message = discovery_pb2.DiscoveryResponse(
        type_url=type_url, nonce=nonce, resources=[_packed(name) for name in names]
    )
    assert string_field(message.SerializeToString(), 4) == type_url
    assert string_field(message.SerializeToString(), 5) == nonce
