"""The two xDS protocol flavours, state of the world (SotW) and Delta, as plain facts about messages.

One definition serves every part of the agent that speaks xDS: the relay between Envoy and istiod
(:mod:`istio_agent.xds.proxy`) and the servers built on the stream core (:mod:`istio_agent.xds.stream`):
which message types a flavour uses, which names a request asks for, how an ACK or a NACK of a
response is written, and how a response is built from resources.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias

from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import status_pb2

ADS_SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"
INTERNAL_CODE = 13
"""google.rpc.Code INTERNAL: the code of the agent's NACKs and of unhealthy health reports."""

Request: TypeAlias = discovery_pb2.DiscoveryRequest | discovery_pb2.DeltaDiscoveryRequest
Response: TypeAlias = discovery_pb2.DiscoveryResponse | discovery_pb2.DeltaDiscoveryResponse


class Resource(NamedTuple):
    """One named resource as a response carries it; packed into an ``Any`` only when it is sent.

    ``message`` may already be an ``Any`` (a resource relayed from elsewhere); it is sent as is.
    """

    name: str
    message: Message
    version: str = ""


@dataclass(slots=True)
class Resources:
    """Resources of one type: ``names`` in the order to send them, and every name's message and version.

    Names and two mappings rather than an object per resource: a server offers thousands per
    snapshot, and mappings it already holds cost nothing to hand over (nor to the garbage collector).
    ``messages`` may hold more names than ``names`` (the whole snapshot of the type).
    """

    names: Sequence[str]
    messages: Mapping[str, Message]
    versions: Mapping[str, str]

    def pick(self, names: Iterable[str]) -> Iterator[tuple[str, Message, str]]:
        """(name, message, version) of ``names``, made one at a time as a response is built."""
        messages, versions = self.messages, self.versions
        return ((name, messages[name], versions.get(name, "")) for name in names)


def _packed(message: Message) -> any_pb2.Any:
    if message.__class__ is any_pb2.Any:
        return message
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def resource_version(message: Message) -> str:
    """A stable version of a resource: hash of its deterministic serialization, 16 hex characters."""
    return hashlib.sha256(message.SerializeToString(deterministic=True)).hexdigest()[:16]


def new_nonce() -> str:
    """A response nonce: a random UUID (v4) in its usual text form, as Istio sends.

    Made from ``os.urandom`` as RFC 9562 lays out version 4, without the ``uuid`` module (~0.5 MB).
    """
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # the RFC's variant
    text = raw.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def unique(names: Iterable[str]) -> list[str]:
    """``names`` without repeats, in first-seen order."""
    return list(dict.fromkeys(names))


def error_detail(error: str | None) -> status_pb2.Status | None:
    """The ``error_detail`` of a NACK (or an unhealthy report) carrying ``error``; None for an ACK."""
    return None if error is None else status_pb2.Status(code=INTERNAL_CODE, message=error)


@dataclass(frozen=True)
class Flavour:
    """What differs between SotW and Delta messages; :data:`SOTW` and :data:`DELTA` are the two."""

    name: str
    """For log lines: "SotW" or "Delta"."""
    method: str
    """The AggregatedDiscoveryService method of this flavour."""
    request_type: Any
    response_type: Any
    delta: bool

    @property
    def label(self) -> str:
        """For metric labels and status: "sotw" or "delta"."""
        return self.name.lower()

    def requested_names(self, request: Any) -> list[str]:
        """The names a request asks for (SotW: all it wants; Delta: those it adds)."""
        return list(request.resource_names_subscribe if self.delta else request.resource_names)

    def agent_request(self, type_url: str) -> Request:
        """A bare subscription to ``type_url`` (the agent's own types)."""
        return self.request_type(type_url=type_url)

    def reply(self, response: Any, error: str | None) -> Request:
        """The ACK (``error`` None) or NACK of ``response``."""
        if self.delta:
            return discovery_pb2.DeltaDiscoveryRequest(
                type_url=response.type_url, response_nonce=response.nonce, error_detail=error_detail(error)
            )
        return discovery_pb2.DiscoveryRequest(
            version_info=response.version_info,
            type_url=response.type_url,
            response_nonce=response.nonce,
            error_detail=error_detail(error),
        )

    def first_resource(self, response: Any) -> any_pb2.Any | None:
        """The first resource of a response (the agent's own types are singletons)."""
        if not response.resources:
            return None
        first = response.resources[0]
        return first.resource if self.delta else first

    def response(
        self,
        type_url: str,
        resources: Iterable[tuple[str, Message, str]],
        *,
        version: str,
        nonce: str,
        removed: Sequence[str] = (),
        control_plane: base_pb2.ControlPlane | None = None,
    ) -> Response:
        """A response carrying ``resources`` ((name, message, version), e.g. :class:`Resource` s; Delta
        also ``removed``) under ``version``."""
        if self.delta:
            return discovery_pb2.DeltaDiscoveryResponse(
                system_version_info=version,
                resources=[
                    discovery_pb2.Resource(name=name, version=item_version, resource=_packed(message))
                    for name, message, item_version in resources
                ],
                type_url=type_url,
                removed_resources=removed,
                nonce=nonce,
                control_plane=control_plane,
            )
        return discovery_pb2.DiscoveryResponse(
            version_info=version,
            resources=[_packed(message) for _, message, _ in resources],
            type_url=type_url,
            nonce=nonce,
            control_plane=control_plane,
        )


SOTW = Flavour(
    "SotW",
    "StreamAggregatedResources",
    discovery_pb2.DiscoveryRequest,
    discovery_pb2.DiscoveryResponse,
    delta=False,
)
DELTA = Flavour(
    "Delta",
    "DeltaAggregatedResources",
    discovery_pb2.DeltaDiscoveryRequest,
    discovery_pb2.DeltaDiscoveryResponse,
    delta=True,
)
