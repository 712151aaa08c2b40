"""Types the agent consumes itself instead of relaying to Envoy: NDS (DNS name table), PCDS (trust bundle).

A handler gets the first resource of a response ("internal types are singletons") and raises
ValueError to have the proxy NACK it; the proxy ACKs otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from google.protobuf import any_pb2
from google.protobuf.message import DecodeError, Message

from istio_agent.log import scope
from istio_agent.pem import PemError, parse_root_bundle
from istio_agent.protos import nds_pb2, proxy_config_pb2
from istio_agent.xds.types import NAME_TABLE, PROXY_CONFIG

log = scope("xdsproxy")

M = TypeVar("M", bound=Message)


def _decode(resource: any_pb2.Any, expected: str, message: M) -> M:
    """``resource`` decoded into ``message``; ValueError (a NACK) when it is another type or unreadable."""
    # istiod always sets the Any's type; an empty one is tolerated as Istio's plain unmarshal would.
    if resource.type_url and resource.type_url != expected:
        raise ValueError(f"unexpected resource type {resource.type_url!r}, expected {expected!r}")
    try:
        message.ParseFromString(resource.value)
    except DecodeError as err:
        raise ValueError(f"cannot decode {type(message).__name__}: {err}") from None
    return message


class NameTableHandler:
    """NDS: keeps the latest NameTable and tells the DNS server about each new one."""

    type_url = NAME_TABLE

    def __init__(self, on_update: Callable[[nds_pb2.NameTable], object] | None = None) -> None:
        self._listeners: list[Callable[[nds_pb2.NameTable], object]] = []
        if on_update is not None:
            self._listeners.append(on_update)
        self.table: nds_pb2.NameTable | None = None

    @property
    def ready(self) -> bool:
        """A table has arrived (agent readiness waits for it: "DNS lookup table is not ready yet")."""
        return self.table is not None

    def add_listener(self, fn: Callable[[nds_pb2.NameTable], object]) -> None:
        self._listeners.append(fn)

    def handle(self, resource: any_pb2.Any) -> None:
        table = _decode(resource, NAME_TABLE, nds_pb2.NameTable())
        self.table = table
        for listener in list(self._listeners):
            try:
                listener(table)
            except Exception:
                # The table itself is fine (it is ACKed); a broken consumer is a bug to report, not a NACK.
                log.exception("NameTable listener %r failed", listener)


class ProxyConfigHandler:
    """PCDS: extra trust anchors from ProxyConfig.ca_certificates_pem, handed to the secret manager."""

    type_url = PROXY_CONFIG

    def __init__(self, update_trust_bundle: Callable[[bytes], None]) -> None:
        self._update = update_trust_bundle

    def handle(self, resource: any_pb2.Any) -> None:
        config = _decode(resource, PROXY_CONFIG, proxy_config_pb2.ProxyConfig())
        for index, pem in enumerate(config.ca_certificates_pem):
            try:
                parse_root_bundle(pem.encode(), f"ProxyConfig.ca_certificates_pem[{index}]")
            except PemError as err:
                # Refused here (NACK) rather than as a broken ROOTCA bundle in Envoy later.
                raise ValueError(str(err)) from None
        self._update("\n".join(config.ca_certificates_pem).encode())
