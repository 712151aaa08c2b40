"""The guard on every connection a Wasm fetch makes: no link-local, no cloud metadata, no refused range.

A Wasm module URL (and every redirect hop, and an OCI registry's token realm) comes from mesh config
an attacker may write: without a guard the agent would fetch its node's cloud credentials for them.
As Istio (``pkg/wasm/ssrf.go``, ``pkg/security/dial.go``), the check is on the address a connection
is actually made to, after name resolution, so neither a redirect nor a name that resolves to a
refused address gets round it. Private and loopback addresses stay allowed: in-cluster registries and
HTTP servers are a legitimate home for modules; operators narrow that with
``BLOCKED_CIDRS_IN_WASM_FETCH``.
"""

from __future__ import annotations

import ipaddress
import ssl
from urllib.parse import urlsplit

from istio_agent.config.wasm import IPNetwork
from istio_agent.http.dial import Stream, open_stream
from istio_agent.wasm.errors import FetchError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

CLOUD_METADATA: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("100.100.100.200/32"),  # Alibaba Cloud, in RFC 6598 shared space
    ipaddress.ip_network("fd00:ec2::/32"),  # AWS IMDS over IPv6, in ULA space AWS reserved for it
)
"""Metadata services outside the link-local ranges (which hold the rest, 169.254.169.254 first)."""
_LINK_LOCAL_MULTICAST_V4 = ipaddress.ip_network("224.0.0.0/24")
_PRIVATE: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")
)
_METADATA_NAMES = frozenset({"metadata.google.internal"})


class DialGuard:
    """Refuses addresses Wasm fetches must never reach: link-local, cloud metadata, ``blocked``."""

    def __init__(self, blocked: tuple[IPNetwork, ...] = ()) -> None:
        self.blocked = blocked

    def check(self, ip: str) -> None:
        """Raise ``FetchError`` (``download_failure``) when a connection to ``ip`` must not be made."""
        try:
            address = ipaddress.ip_address(ip)
        except ValueError:
            raise FetchError(f"connection blocked: {ip!r} is not an IP address") from None
        plain = _unmapped(address)
        if _link_local(plain):
            raise FetchError(f"connection blocked: resolved IP {ip} is link-local")
        if any(plain in network for network in CLOUD_METADATA):
            raise FetchError(f"connection blocked: resolved IP {ip} is a known cloud metadata address")
        for network in self.blocked:
            if plain in network or address in network:
                raise FetchError(f"connection blocked: resolved IP {ip} is in blocked CIDR range {network}")


async def open_guarded_stream(
    host: str, port: int, *, tls: ssl.SSLContext | None, guard: DialGuard
) -> Stream:
    """Dial ``host:port`` on an address ``guard`` allows (TLS with SNI ``host`` when ``tls`` is given).

    Every resolved address is checked before it is dialled; refused ones are skipped and, when all are
    refused, the guard's ``FetchError`` (naming ``host``) is raised. Resolution, connection and
    handshake failures are the ``OSError`` ``istio_agent.http.dial.open_stream`` raises.
    """
    try:
        return await open_stream(host, port, tls=tls, server_hostname=host, check_address=guard.check)
    except FetchError as err:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise FetchError(f"{where}: {err}", err.reason) from None


def check_bearer_realm(realm: str) -> None:
    """Refuse an OCI registry's token ``realm`` the agent must not send a request to.

    Istio's rules (``pkg/wasm/imagefetcher.go``, ``validateRealmURL``): http(s) only, a host, not the
    GCP metadata name nor ``localhost``, no private, loopback or link-local IP literal. Stricter here
    where Istio compares strings as written: the host is compared case-insensitively and without a
    trailing dot, ``*.localhost`` counts as localhost, IPv4-mapped IPv6 literals are read as the IPv4
    address they are, and the cloud-metadata and unspecified (``0.0.0.0``, ``::``) addresses are
    refused too. The dial guard still applies to whatever a realm resolves to.
    """
    try:
        parts = urlsplit(realm)
        host = parts.hostname
    except ValueError as err:
        raise FetchError(f"invalid bearer realm URL {realm!r}: {err}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise FetchError(f"bearer realm {realm!r}: scheme {parts.scheme!r} not allowed")
    if not host:
        raise FetchError(f"bearer realm {realm!r}: no host")
    host = host.rstrip(".")
    if host in _METADATA_NAMES:
        raise FetchError(f"bearer realm {realm!r} targets the cloud metadata service")
    if host == "localhost" or host.endswith(".localhost"):
        raise FetchError(f"bearer realm {realm!r} targets localhost")
    try:
        address = _unmapped(ipaddress.ip_address(host))
    except ValueError:
        return  # a name: the dial guard checks what it resolves to
    if (
        address.is_loopback
        or address.is_unspecified
        or _link_local(address)
        or any(address in network for network in _PRIVATE + CLOUD_METADATA)
    ):
        raise FetchError(
            f"bearer realm {realm!r} targets a private, loopback, link-local or metadata address"
        )


def _unmapped(address: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address is the IPv4 address it carries (as Go's ``net.IP`` reads it)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _link_local(address: IPAddress) -> bool:
    """Link-local unicast (169.254/16, fe80::/10) or multicast (224.0.0/24, ff02::/16 and other ffX2)."""
    if address.is_link_local:
        return True
    if isinstance(address, ipaddress.IPv4Address):
        return address in _LINK_LOCAL_MULTICAST_V4
    packed = address.packed
    return packed[0] == 0xFF and packed[1] & 0x0F == 0x02
