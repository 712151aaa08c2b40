"""What the agent learns from the machine it runs on: interface addresses and name resolution.

Kept out of ``config`` (which only reads settings) and called once at start-up by the command line,
which hands the answers to ``BootstrapSettings.from_env`` as a :class:`LocalHost`; tests hand it a
fake with the addresses they need. Interfaces are listed with the standard library only (SIOCGIFCONF
for IPv4, ``/proc/net/if_inet6`` for IPv6), as Istio's agent lists them with Go's net package.
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

from istio_agent.log import scope

log = scope("bootstrap")

_SIOCGIFCONF = 0x8912
_IFREQ_SIZE = 40  # struct ifreq on 64-bit Linux: 16-byte name + 24-byte union
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8
_IFA_F_DADFAILED = 0x08


class LocalHost:
    """This machine, as ``BootstrapSettings.from_env`` asks about it (its ``HostFacts``)."""

    def interface_addresses(self) -> list[tuple[str, str]]:
        return interface_addresses()

    def resolve(self, host: str, port: int) -> str:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        return str(infos[0][4][0])


def interface_addresses() -> list[tuple[str, str]]:
    """(interface, IP) of up, non-loopback interfaces, without loopback/link-local/unspecified IPs."""
    found: list[tuple[str, str]] = []
    try:
        found.extend(_ipv4_addresses())
    except OSError as err:
        log.debug("listing IPv4 interface addresses failed: %s", err)
    found.extend(_ipv6_addresses())
    found = [(name, ip) for name, ip in found if _interface_up(name)]
    if not found:
        found = [("", ip) for ip in _hostname_addresses()]
    return [(name, ip) for name, ip in found if _usable(ip)]


def _usable(ip: str) -> bool:
    try:
        address = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return False
    return not (address.is_loopback or address.is_link_local or address.is_unspecified)


def _ipv4_addresses() -> list[tuple[str, str]]:
    """IPv4 addresses per interface via SIOCGIFCONF (stdlib only, no psutil)."""
    slots = 256
    buffer = array.array("B", bytes(slots * _IFREQ_SIZE))
    pointer, _ = buffer.buffer_info()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        result = fcntl.ioctl(sock.fileno(), _SIOCGIFCONF, struct.pack("iL", len(buffer), pointer))
    length, _ = struct.unpack("iL", result)
    data = buffer.tobytes()[:length]
    addresses = []
    for offset in range(0, length, _IFREQ_SIZE):
        name = data[offset : offset + 16].split(b"\0", 1)[0].decode(errors="replace")
        addresses.append((name, socket.inet_ntoa(data[offset + 20 : offset + 24])))
    return addresses


def _ipv6_addresses() -> list[tuple[str, str]]:
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return []
    addresses = []
    for line in lines:
        fields = line.split()
        if len(fields) != 6 or len(fields[0]) != 32:
            continue
        try:
            flags = int(fields[4], 16)
            packed = bytes.fromhex(fields[0])
        except ValueError:
            continue
        if flags & _IFA_F_DADFAILED:
            continue
        addresses.append((fields[5], str(ipaddress.IPv6Address(packed))))
    return addresses


def _interface_up(name: str) -> bool:
    try:
        flags = int(Path(f"/sys/class/net/{name.split(':')[0]}/flags").read_text().strip(), 16)
    except (OSError, ValueError):
        return True  # no sysfs (or an alias we cannot map): trust the address listing
    return bool(flags & _IFF_UP) and not flags & _IFF_LOOPBACK


def _hostname_addresses() -> list[str]:
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, proto=socket.IPPROTO_TCP)
    except OSError:
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))
