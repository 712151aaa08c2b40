"""The xDS proxy's parts on their own: outcome classes, health reports, the debug tap's waiting state.

The relay through them is tested end to end in test_proxy.py and test_tap.py.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2

from istio_agent.metrics import PREFIX, Registry
from istio_agent.rpc import Status
from istio_agent.xds.flavour import DELTA, SOTW
from istio_agent.xds.health_report import HealthReport
from istio_agent.xds.outcome import Outcomes, UpstreamError, classify
from istio_agent.xds.proxy_metrics import ProxyMetrics
from istio_agent.xds.proxy_stream import ProxyStream
from istio_agent.xds.questions import DebugQuestions, TapError, TapTimeout, as_sotw_response
from istio_agent.xds.types import HEALTH_INFO
from istio_agent.xds.wire import RawResponse

DEBUG = "istio.io/debug/syncz"


@pytest.mark.parametrize(
    ("code", "details", "kind"),
    [
        (Status.OK, "", "cancelled"),
        (Status.CANCELLED, "whatever", "cancelled"),
        (Status.DEADLINE_EXCEEDED, "", "cancelled"),
        (Status.UNAVAILABLE, "transport is closing", "cancelled"),
        (Status.UNAVAILABLE, "connection refused", "error"),
        (Status.INTERNAL, "received prior goaway: code: NO_ERROR", "cancelled"),
        (Status.INTERNAL, "boom", "error"),
    ],
)
def test_classify_is_istios_grpc_error_type(code: Status, details: str, kind: str) -> None:
    assert classify(code, details) == kind


def test_no_health_request_before_a_report_then_one_per_flavour() -> None:
    report = HealthReport()
    assert report.request(SOTW) is None and report.request(DELTA) is None
    report.update(False, "probe failed")
    sotw, delta = report.request(SOTW), report.request(DELTA)
    assert isinstance(sotw, discovery_pb2.DiscoveryRequest) and sotw.type_url == HEALTH_INFO
    assert isinstance(delta, discovery_pb2.DeltaDiscoveryRequest) and delta.type_url == HEALTH_INFO
    assert sotw.error_detail.message == delta.error_detail.message == "probe failed"
    report.update(True)
    healthy = report.request(SOTW)
    assert healthy is not None and not healthy.HasField("error_detail")


def test_a_delta_debug_answer_is_given_in_sotw_form() -> None:
    resource = any_pb2.Any(type_url=DEBUG, value=b"x")
    delta = discovery_pb2.DeltaDiscoveryResponse(
        type_url=DEBUG,
        nonce="n",
        system_version_info="v1",
        resources=[discovery_pb2.Resource(resource=resource)],
    )
    answer = as_sotw_response(DELTA, RawResponse(delta.SerializeToString(), DEBUG))
    assert answer == discovery_pb2.DiscoveryResponse(
        type_url=DEBUG, nonce="n", version_info="v1", resources=[resource]
    )


async def test_a_question_without_a_stream_is_a_tap_error() -> None:
    questions = DebugQuestions({}, lambda: "istiod:15012")

    async def never(stream: ProxyStream, request: object) -> None:
        raise AssertionError("nothing to send on")

    with pytest.raises(TapError, match="not connected"):
        await questions.ask(discovery_pb2.DiscoveryRequest(type_url=DEBUG), 1.0, never)


async def test_a_question_is_asked_on_the_newest_stream_and_answered_there() -> None:
    older, newest = ProxyStream(1, SOTW, call=object()), ProxyStream(2, DELTA, call=object())
    questions = DebugQuestions({1: older, 2: newest}, lambda: "istiod:15012")
    sent: list[tuple[int, object]] = []

    async def send(stream: ProxyStream, request: object) -> None:
        sent.append((stream.id, request))
        questions.answer(older, RawResponse(b"", DEBUG))  # another stream's answer is not this one
        reply = discovery_pb2.DeltaDiscoveryResponse(type_url=DEBUG, nonce="n2")
        questions.answer(stream, RawResponse(reply.SerializeToString(), DEBUG))

    answer = await questions.ask(
        discovery_pb2.DiscoveryRequest(type_url=DEBUG, resource_names=["a"]), 1.0, send
    )
    assert answer.nonce == "n2"
    assert sent == [(2, discovery_pb2.DeltaDiscoveryRequest(type_url=DEBUG, resource_names_subscribe=["a"]))]


async def test_an_unanswered_question_times_out_and_a_failed_send_names_the_upstream() -> None:
    stream = ProxyStream(1, SOTW, call=object())
    questions = DebugQuestions({1: stream}, lambda: "istiod:15012")

    async def silent(stream: ProxyStream, request: object) -> None:
        return None

    async def failing(stream: ProxyStream, request: object) -> None:
        raise UpstreamError(Status.UNAVAILABLE, "gone")

    with pytest.raises(TapTimeout, match=r"within 0\.05s"):
        await questions.ask(discovery_pb2.DiscoveryRequest(type_url=DEBUG), 0.05, silent)
    with pytest.raises(TapError, match="xDS upstream istiod:15012: gone"):
        await questions.ask(discovery_pb2.DiscoveryRequest(type_url=DEBUG), 1.0, failing)


class Dialer:
    address = "istiod:15012"

    def describe(self) -> str:
        return "istiod:15012 (plaintext)"


def test_repeated_connect_failures_warn_once_and_count(caplog: pytest.LogCaptureFixture) -> None:
    registry = Registry()
    outcomes = Outcomes(ProxyMetrics(registry), Dialer())  # type: ignore[arg-type]
    stream = ProxyStream(1, SOTW)
    caplog.set_level(logging.DEBUG)
    for _ in range(3):
        outcome = outcomes.settle(stream, UpstreamError(Status.UNAVAILABLE, "refused"))
        assert outcome.code == Status.UNAVAILABLE
        assert outcome.details == "xDS upstream istiod:15012 (plaintext): refused"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["cannot connect to xDS upstream istiod:15012 (plaintext): UNAVAILABLE: refused"]
    assert registry.sample(PREFIX + "istiod_connection_failures") == 3
    outcomes.connected()
    assert "connected to istiod:15012 after 3 failed attempts" in caplog.text


def test_a_stopping_stream_ends_with_ok_whatever_the_error() -> None:
    outcomes = Outcomes(ProxyMetrics(Registry()), Dialer())  # type: ignore[arg-type]
    stream = ProxyStream(1, SOTW)
    stream.shutdown()
    assert outcomes.settle(stream, UpstreamError(Status.INTERNAL, "x")).code == Status.OK
    assert outcomes.settle(ProxyStream(2, SOTW), asyncio.CancelledError()).code == Status.OK
