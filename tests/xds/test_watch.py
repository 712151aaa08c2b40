"""The SotW and Delta request rules on their own, including the corners the servers' tests do not reach."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from envoy.service.discovery.v3 import discovery_pb2
from google.rpc import status_pb2

from istio_agent.xds.watch import (
    MAX_ERROR_TEXT,
    Policy,
    Send,
    Verdict,
    Watch,
    delta_request,
    error_text,
    sotw_request,
)

EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ISTIOD = Policy(wildcard_types=frozenset({CDS}), answer_first_delta=True)
SDS = Policy(ack_sends_added_only=True)


def sotw(names: list[str], nonce: str = "", error: str | None = None) -> Any:
    request = discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=names, response_nonce=nonce)
    if error is not None:
        request.error_detail.CopyFrom(status_pb2.Status(code=13, message=error))
    return request


def delta(
    subscribe: Sequence[str] = (),
    unsubscribe: Sequence[str] = (),
    nonce: str = "",
    initial: dict[str, str] | None = None,
    error: str | None = None,
    type_url: str = EDS,
) -> Any:
    request = discovery_pb2.DeltaDiscoveryRequest(
        type_url=type_url,
        resource_names_subscribe=subscribe,
        resource_names_unsubscribe=unsubscribe,
        response_nonce=nonce,
        initial_resource_versions=initial or {},
    )
    if error is not None:
        request.error_detail.CopyFrom(status_pb2.Status(code=13, message=error))
    return request


def sent(watches: dict[str, Watch], nonce: str, type_url: str = EDS) -> Watch:
    watch = watches[type_url]
    watch.sent(nonce, "v", 1)
    return watch


# -- SotW ----------------------------------------------------------------------------------------------


def test_sotw_ack_that_changes_names_answers_per_policy() -> None:
    for policy, added_only in ((ISTIOD, False), (SDS, True)):
        watches: dict[str, Watch] = {}
        assert sotw_request(watches, EDS, sotw(["a", "b"]), policy).send == Send(None)
        sent(watches, "n1")
        grown = sotw_request(watches, EDS, sotw(["b", "a", "c"], "n1"), policy)
        assert grown.verdict is Verdict.ACK
        assert grown.send == (Send(("c",)) if added_only else Send(None))
        assert list(watches[EDS].names) == ["b", "a", "c"]
        shrunk = sotw_request(watches, EDS, sotw(["c"], "n1"), policy)
        assert shrunk.send == (None if added_only else Send(None))
        assert sotw_request(watches, EDS, sotw(["c"], "n1"), policy).send is None  # same names: nothing


def test_sotw_unsubscribe_comes_before_the_nonce_check() -> None:
    # Istio's ShouldRespond: a request without names unsubscribes, whatever nonce it carries.
    watches: dict[str, Watch] = {}
    sotw_request(watches, EDS, sotw(["a"]), ISTIOD)
    sent(watches, "n1")
    decision = sotw_request(watches, EDS, sotw([], "stale"), ISTIOD)
    assert decision.verdict is Verdict.UNSUBSCRIBE and watches == {}


def test_sotw_nack_is_recorded_only_for_the_last_nonce() -> None:
    watches: dict[str, Watch] = {}
    sotw_request(watches, EDS, sotw(["a"]), ISTIOD)
    watch = sent(watches, "n1")
    old = sotw_request(watches, EDS, sotw(["a"], "n0", error="bad"), ISTIOD)
    assert (old.verdict, old.watch, watch.error) == (Verdict.NACK, None, None)
    current = sotw_request(watches, EDS, sotw(["a", "b"], "n1", error="bad"), ISTIOD)
    assert (current.verdict, current.watch, current.send) == (Verdict.NACK, watch, None)
    assert (watch.error, watch.acked_nonce, list(watch.names)) == ("bad", "n1", ["a"])  # names untouched
    assert watch.status().config_status == "ERROR"  # istiod (since 1.23): a NACKed type is in ERROR
    sotw_request(watches, EDS, sotw(["a"], "n1"), ISTIOD)
    assert watch.error is None and watch.status().config_status == "SYNCED"


def test_sotw_wildcard_type_ignores_names() -> None:
    watches: dict[str, Watch] = {}
    decision = sotw_request(watches, CDS, sotw(["x"]), ISTIOD)
    assert decision.watch is not None and decision.watch.wildcard and decision.watch.names == {}
    sent(watches, "n1", CDS)
    assert sotw_request(watches, CDS, sotw([], "n1"), ISTIOD).verdict is Verdict.ACK


def test_error_text_is_bounded_and_never_empty() -> None:
    assert error_text(sotw([], "n", error="x" * 5000)) == "x" * MAX_ERROR_TEXT
    assert error_text(sotw([], "n", error="")) == "code 13"


# -- Delta ---------------------------------------------------------------------------------------------


def test_delta_first_request_is_answered_per_policy() -> None:
    for policy, always in ((ISTIOD, True), (SDS, False)):
        watches: dict[str, Watch] = {}
        assert delta_request(watches, EDS, delta(), policy).send == Send((), always=always)
        assert delta_request(watches, EDS, delta(["a"]), policy).send == Send(("a",), always=False)


def test_delta_resubscription_is_sent_again_unless_the_client_holds_it() -> None:
    watches: dict[str, Watch] = {}
    delta_request(watches, EDS, delta(["a", "b"], initial={"a": "v1"}), ISTIOD)
    watch = watches[EDS]
    assert watch.client_versions == {"a": "v1"}
    watch.client_versions["b"] = "v2"  # what the server then sent
    again = delta_request(watches, EDS, delta(["b"]), ISTIOD)
    assert again.send == Send(("b",), always=False) and watch.client_versions == {"a": "v1"}


def test_delta_initial_versions_subscribe_those_names() -> None:
    watches: dict[str, Watch] = {}
    decision = delta_request(watches, EDS, delta(initial={"a": "v1"}), SDS)
    assert decision.send == Send(("a",), always=False)
    assert list(watches[EDS].names) == ["a"] and watches[EDS].client_versions == {"a": "v1"}


def test_delta_wildcard_subscribe_and_unsubscribe() -> None:
    watches: dict[str, Watch] = {}
    first = delta_request(watches, CDS, delta(["x"], type_url=CDS), ISTIOD)
    assert first.watch is not None and not first.watch.wildcard and first.send == Send(("x",))
    everything = delta_request(watches, CDS, delta(["*"], type_url=CDS), ISTIOD)
    assert everything.watch is not None and everything.watch.wildcard and everything.send == Send(None, False)
    watches[CDS].client_versions.update({"x": "1", "y": "1"})
    delta_request(watches, CDS, delta(unsubscribe=["*"], type_url=CDS), ISTIOD)
    assert not watches[CDS].wildcard and watches[CDS].client_versions == {"x": "1"}  # y is dropped
    # "*" means nothing on a type that is never wildcard.
    named = delta_request(watches, EDS, delta(["*"]), ISTIOD)
    assert named.watch is not None and not named.watch.wildcard and named.send == Send((), always=True)


def test_delta_nack_changes_nothing_and_stale_nonce_still_subscribes() -> None:
    watches: dict[str, Watch] = {}
    delta_request(watches, EDS, delta(["a"]), SDS)
    watch = sent(watches, "n1")
    nack = delta_request(watches, EDS, delta(["b"], nonce="n1", error="bad"), SDS)
    assert (nack.verdict, nack.watch, nack.send) == (Verdict.NACK, watch, None)
    assert list(watch.names) == ["a"] and watch.error == "bad"
    stale = delta_request(watches, EDS, delta(["b"], nonce="n0"), SDS)
    assert stale.verdict is Verdict.STALE and stale.send == Send(("b",), always=False)
    ack = delta_request(watches, EDS, delta(unsubscribe=["a"], nonce="n1"), SDS)
    assert ack.verdict is Verdict.ACK and list(watch.names) == ["b"] and watch.error is None
