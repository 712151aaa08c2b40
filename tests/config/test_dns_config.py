from __future__ import annotations

import logging
from pathlib import Path

import pytest

from istio_agent.config import ConfigError, Env
from istio_agent.config.dns import DnsSettings, normalise_proxy_domain, split_host_port


def dns(
    *,
    proxy_type: str = "sidecar",
    domain: str | None = None,
    is_root: bool = False,
    metadata: dict[str, str] | None = None,
    vm_resolv_conf: Path = Path("/nonexistent/istio/resolv.conf"),
    **env: str,
) -> DnsSettings:
    """Settings with DNS capture on unless the test says otherwise (off, nothing else is read)."""
    switches = ("ISTIO_META_DNS_CAPTURE", "ISTIO_META_ENABLE_DNS_SERVER")
    if not any(name in env or name in (metadata or {}) for name in switches):
        env["ISTIO_META_DNS_CAPTURE"] = "true"
    return DnsSettings.from_env(
        Env(env),
        proxy_type=proxy_type,
        domain=domain,
        is_root=is_root,
        proxy_metadata=metadata,
        vm_resolv_conf=vm_resolv_conf,
    )


def test_defaults_follow_istio() -> None:
    assert dns() == DnsSettings(
        enabled=True,
        listen_address="localhost:15053",
        resolv_conf=Path("/etc/resolv.conf"),
        forward_parallel=False,
        forward_timeout=5.0,
        forward_retries=0,
        cache=False,
        proxy_namespace="",
        proxy_domain="svc.cluster.local",
        respond_before_sync=False,
    )


@pytest.mark.parametrize(
    ("proxy_type", "env", "enabled"),
    [
        ("sidecar", {"ISTIO_META_DNS_CAPTURE": "true"}, True),
        ("router", {"ISTIO_META_DNS_CAPTURE": "true"}, False),  # capture is for sidecars only
        ("router", {"ISTIO_META_ENABLE_DNS_SERVER": "true"}, True),
        ("sidecar", {"ISTIO_META_ENABLE_DNS_SERVER": "1"}, True),
        ("sidecar", {"ISTIO_META_DNS_CAPTURE": "false", "ISTIO_META_ENABLE_DNS_SERVER": "False"}, False),
    ],
)
def test_enabled(proxy_type: str, env: dict[str, str], enabled: bool) -> None:
    assert dns(proxy_type=proxy_type, **env).enabled is enabled


def test_proxy_metadata_fills_in_and_env_wins() -> None:
    assert dns(metadata={"ISTIO_META_DNS_CAPTURE": "true"}).enabled
    assert not dns(metadata={"ISTIO_META_DNS_CAPTURE": "true"}, ISTIO_META_DNS_CAPTURE="false").enabled
    assert dns(metadata={"DNS_FORWARD_RETRIES": "2"}).forward_retries == 2


@pytest.mark.parametrize(
    ("namespace", "domain", "expected"),
    [
        ("ns1", None, "svc.cluster.local"),
        ("ns1", "", "svc.cluster.local"),
        ("ns1", "ns1.svc.cluster.local", "svc.cluster.local"),
        ("ns1", "ns2.svc.cluster.local", "ns2.svc.cluster.local"),
        ("ns1", "ns1.svc.corp.example", "svc.corp.example"),
        ("ns1", "ns1x.svc.cluster.local", "ns1x.svc.cluster.local"),
        ("ns1", "ns1", ""),
    ],
)
def test_proxy_domain_normalisation(namespace: str, domain: str | None, expected: str) -> None:
    settings = dns(domain=domain, POD_NAMESPACE=namespace)
    assert settings.proxy_namespace == namespace
    assert settings.proxy_domain == expected


def test_normalise_without_namespace() -> None:
    assert normalise_proxy_domain(".svc.cluster.local", "") == "svc.cluster.local"


def test_every_setting_from_env() -> None:
    settings = dns(
        DNS_PROXY_ADDR="[::1]:5353",
        DNS_FORWARD_PARALLEL="true",
        DNS_FORWARD_TIMEOUT="1.5s",
        DNS_FORWARD_RETRIES="3",
        DNS_CACHE="true",
        ISTIO_AGENT_RESOLV_CONF="/tmp/resolv.conf",
    )
    assert settings.listen_address == "[::1]:5353"
    assert settings.forward_parallel and settings.cache
    assert settings.forward_timeout == 1.5
    assert settings.forward_retries == 3
    assert settings.resolv_conf == Path("/tmp/resolv.conf")
    assert dns(DNS_FORWARD_TIMEOUT="250ms").forward_timeout == 0.25


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("DNS_PROXY_ADDR", "localhost"),
        ("DNS_PROXY_ADDR", "localhost:dns"),
        ("DNS_PROXY_ADDR", "localhost:70000"),
        ("DNS_PROXY_ADDR", "::1:15053"),
        ("DNS_PROXY_ADDR", "[::1]15053"),
        ("DNS_PROXY_ADDR", "[::1:15053"),
        ("DNS_FORWARD_TIMEOUT", "5"),
        ("DNS_FORWARD_TIMEOUT", "0s"),
        ("DNS_FORWARD_TIMEOUT", "-1s"),
        ("DNS_FORWARD_RETRIES", "-1"),
        ("DNS_FORWARD_RETRIES", "many"),
        ("DNS_FORWARD_PARALLEL", "yes"),
        ("DNS_CACHE", "maybe"),
        ("ISTIO_META_DNS_CAPTURE", "on"),
        ("ISTIO_META_ENABLE_DNS_SERVER", "enabled"),
    ],
)
def test_invalid_values_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"invalid value for {name}="):
        dns(**{name: value})


def test_port_53_as_root_prefers_the_vm_resolv_conf(tmp_path: Path) -> None:
    vm = tmp_path / "resolv.conf"
    vm.write_text("nameserver 10.0.0.1\n")
    settings = dns(is_root=True, vm_resolv_conf=vm, DNS_PROXY_ADDR="0.0.0.0:53")
    assert settings.listen_address == "0.0.0.0:53"
    assert settings.resolv_conf == vm
    assert settings.respond_before_sync


def test_port_53_as_root_without_vm_resolv_conf(tmp_path: Path) -> None:
    settings = dns(is_root=True, vm_resolv_conf=tmp_path / "missing", DNS_PROXY_ADDR="127.0.0.1:53")
    assert settings.resolv_conf == Path("/etc/resolv.conf")
    assert settings.respond_before_sync


def test_port_53_as_root_explicit_resolv_conf_wins(tmp_path: Path) -> None:
    vm = tmp_path / "resolv.conf"
    vm.write_text("nameserver 10.0.0.1\n")
    settings = dns(
        is_root=True, vm_resolv_conf=vm, DNS_PROXY_ADDR="[::]:53", ISTIO_AGENT_RESOLV_CONF="/etc/other.conf"
    )
    assert settings.resolv_conf == Path("/etc/other.conf")
    assert settings.respond_before_sync


def test_port_53_without_root_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="istio.dns")
    vm = tmp_path / "resolv.conf"
    vm.write_text("nameserver 10.0.0.1\n")
    settings = dns(vm_resolv_conf=vm, DNS_PROXY_ADDR="0.0.0.0:53", ISTIO_META_DNS_CAPTURE="true")
    assert settings.listen_address == "localhost:15053"
    assert settings.resolv_conf == Path("/etc/resolv.conf")
    assert not settings.respond_before_sync
    assert "0.0.0.0:53" in caplog.text and "root" in caplog.text


def test_other_ports_are_not_special_for_root(tmp_path: Path) -> None:
    vm = tmp_path / "resolv.conf"
    vm.write_text("")
    settings = dns(is_root=True, vm_resolv_conf=vm, DNS_PROXY_ADDR="localhost:5300")
    assert settings.listen_address == "localhost:5300"
    assert settings.resolv_conf == Path("/etc/resolv.conf")
    assert not settings.respond_before_sync


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("localhost:15053", ("localhost", 15053)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("[::1]:53", ("::1", 53)),
        ("[fe80::1%eth0]:53", ("fe80::1%eth0", 53)),
        (":15053", ("", 15053)),
    ],
)
def test_split_host_port(address: str, expected: tuple[str, int]) -> None:
    assert split_host_port(address) == expected


def test_bad_values_do_not_matter_while_dns_is_off() -> None:
    off = dns(
        ISTIO_META_DNS_CAPTURE="false",
        DNS_PROXY_ADDR="localhost",
        DNS_FORWARD_TIMEOUT="5",
        DNS_FORWARD_RETRIES="many",
        POD_NAMESPACE="ns1",
    )
    assert off == DnsSettings(enabled=False, proxy_namespace="ns1")
    with pytest.raises(ConfigError, match="DNS_PROXY_ADDR"):
        dns(DNS_PROXY_ADDR="localhost")  # the same value with DNS on is an error naming the variable
