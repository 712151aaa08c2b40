"""Agent-handled xDS types: NDS name table and PCDS trust bundle."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from google.protobuf import any_pb2

from istio_agent.config import SecuritySettings
from istio_agent.metrics import Registry
from istio_agent.protos import nds_pb2, proxy_config_pb2
from istio_agent.security.manager import SecretManager
from istio_agent.security.model import ROOT_CERT
from istio_agent.xds.handlers import NameTableHandler, ProxyConfigHandler
from istio_agent.xds.types import NAME_TABLE, PROXY_CONFIG
from tests.security.certs import make_ca, to_pem


def packed(message: nds_pb2.NameTable | proxy_config_pb2.ProxyConfig) -> any_pb2.Any:
    resource = any_pb2.Any()
    resource.Pack(message)
    return resource


def table(*hosts: str) -> nds_pb2.NameTable:
    result = nds_pb2.NameTable()
    for index, host in enumerate(hosts):
        info = result.table[host]
        info.ips.append(f"10.0.0.{index + 1}")
        info.registry = "Kubernetes"
    return result


# -- NDS ------------------------------------------------------------------------------------------
def test_name_table_is_stored_and_listeners_called() -> None:
    first: list[nds_pb2.NameTable] = []
    second: list[nds_pb2.NameTable] = []
    handler = NameTableHandler(first.append)
    handler.add_listener(second.append)
    assert handler.type_url == NAME_TABLE
    assert not handler.ready and handler.table is None
    handler.handle(packed(table("a.default.svc.cluster.local")))
    assert handler.ready
    assert handler.table == table("a.default.svc.cluster.local")
    handler.handle(packed(table("b.default.svc.cluster.local")))
    assert handler.table == table("b.default.svc.cluster.local")
    assert first == second == [table("a.default.svc.cluster.local"), table("b.default.svc.cluster.local")]


def test_undecodable_name_table_is_rejected_and_keeps_the_last_one() -> None:
    handler = NameTableHandler()
    handler.handle(packed(table("a.default.svc.cluster.local")))
    with pytest.raises(ValueError, match="NameTable"):
        handler.handle(any_pb2.Any(type_url=NAME_TABLE, value=b"\x0a\xff\xff\xff"))
    assert handler.table == table("a.default.svc.cluster.local")


def test_name_table_of_another_type_is_rejected() -> None:
    handler = NameTableHandler()
    with pytest.raises(ValueError, match="unexpected resource type"):
        handler.handle(packed(proxy_config_pb2.ProxyConfig()))
    assert not handler.ready


def test_failing_listener_does_not_reject_the_table(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[nds_pb2.NameTable] = []

    def broken(_: nds_pb2.NameTable) -> None:
        raise RuntimeError("dns server bug")

    handler = NameTableHandler(broken)
    handler.add_listener(seen.append)
    with caplog.at_level(logging.ERROR):
        handler.handle(packed(table("a.default.svc.cluster.local")))
    assert handler.ready and len(seen) == 1
    assert "dns server bug" in caplog.text


# -- PCDS -----------------------------------------------------------------------------------------
def test_proxy_config_certificates_are_joined_into_a_bundle() -> None:
    bundles: list[bytes] = []
    handler = ProxyConfigHandler(bundles.append)
    assert handler.type_url == PROXY_CONFIG
    first, second = to_pem(make_ca("one")[1]).decode(), to_pem(make_ca("two")[1]).decode()
    handler.handle(packed(proxy_config_pb2.ProxyConfig(ca_certificates_pem=[first, second])))
    assert bundles == [f"{first}\n{second}".encode()]


def test_proxy_config_without_certificates_clears_the_bundle() -> None:
    bundles: list[bytes] = []
    ProxyConfigHandler(bundles.append).handle(packed(proxy_config_pb2.ProxyConfig()))
    assert bundles == [b""]


def test_proxy_config_with_a_bad_certificate_is_rejected() -> None:
    bundles: list[bytes] = []
    good = to_pem(make_ca("one")[1]).decode()
    handler = ProxyConfigHandler(bundles.append)
    with pytest.raises(ValueError, match=r"ca_certificates_pem\[1\]"):
        handler.handle(packed(proxy_config_pb2.ProxyConfig(ca_certificates_pem=[good, "not a certificate"])))
    assert bundles == []


def test_undecodable_proxy_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="ProxyConfig"):
        ProxyConfigHandler(lambda _: None).handle(any_pb2.Any(type_url=PROXY_CONFIG, value=b"\x92\x02\xff"))


def test_proxy_config_keeps_unknown_fields_out_of_the_way() -> None:
    """istiod sends the whole ProxyConfig; fields we do not declare must not break decoding."""
    bundles: list[bytes] = []
    cert = to_pem(make_ca("one")[1]).decode()
    wire = proxy_config_pb2.ProxyConfig(ca_certificates_pem=[cert]).SerializeToString()
    wire = b"\x0a\x0e./etc/istio/px" + wire  # field 1 (configPath) as istiod would send it
    ProxyConfigHandler(bundles.append).handle(any_pb2.Any(type_url=PROXY_CONFIG, value=wire))
    assert bundles == [cert.encode()]


async def test_proxy_config_feeds_the_secret_manager(tmp_path: Path) -> None:
    """The handler plugs straight into SecretManager.update_trust_bundle (ROOTCA is re-pushed)."""
    manager = SecretManager(SecuritySettings(workdir=tmp_path), ca_client=None, registry=Registry())
    pushed: list[str] = []
    manager.add_update_callback(pushed.append)
    cert = to_pem(make_ca("extra")[1]).decode()
    try:
        ProxyConfigHandler(manager.update_trust_bundle).handle(
            packed(proxy_config_pb2.ProxyConfig(ca_certificates_pem=[cert]))
        )
    finally:
        await manager.stop()
    assert ROOT_CERT in pushed
