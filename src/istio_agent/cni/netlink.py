"""The few rtnetlink requests the capture needs, on a raw socket: no ``ip`` binary on the node.

Addresses (read, and ``::6/128`` put on ``lo``), the TPROXY policy rule (``fwmark <mark> lookup
<table>``) and its ``local default dev lo`` route. Each function works in the network namespace of
the thread that calls it (:func:`istio_agent.cni.netns.in_namespace`) and raises ``OSError`` with
the kernel's errno when a request is refused. Message layouts: ``linux/netlink.h``,
``linux/rtnetlink.h``, ``linux/if_addr.h``, ``linux/fib_rules.h``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Iterator

_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port
_IFADDR = struct.Struct("=BBBBI")  # ifaddrmsg: family, prefix length, flags, scope, interface index
_RTMSG = struct.Struct("=BBBBBBBBI")  # rtmsg / fib_rule_hdr: both 12 bytes, laid out alike
_ATTR = struct.Struct("=HH")  # rtattr: length, type
_U32 = struct.Struct("=I")

NLMSG_ERROR, NLMSG_DONE = 2, 3
RTM_NEWADDR, RTM_GETADDR = 20, 22
RTM_NEWROUTE, RTM_DELROUTE, RTM_GETROUTE = 24, 25, 26
RTM_NEWRULE, RTM_DELRULE, RTM_GETRULE = 32, 33, 34
NLM_F_REQUEST, NLM_F_ACK, NLM_F_DUMP = 0x1, 0x4, 0x300
NLM_F_REPLACE, NLM_F_EXCL, NLM_F_CREATE = 0x100, 0x200, 0x400
IFA_ADDRESS, IFA_LOCAL = 1, 2
RTA_OIF, RTA_TABLE = 4, 15
FRA_PRIORITY, FRA_FWMARK, FRA_TABLE, FRA_FWMASK = 6, 10, 15, 16
FR_ACT_TO_TBL = 1
RTN_LOCAL = 2
RTPROT_BOOT = 3
RT_SCOPE_HOST = 254
_FAMILIES = {"v4": socket.AF_INET, "v6": socket.AF_INET6}


def addresses() -> list[str]:
    """Every interface address, in the kernel's dump order (IPv4 first, then IPv6, by interface)."""
    found = []
    for kind, payload in _dump(RTM_GETADDR, _IFADDR.pack(socket.AF_UNSPEC, 0, 0, 0, 0)):
        if kind != RTM_NEWADDR:
            continue
        family = payload[0]
        attrs = dict(_attributes(payload[_IFADDR.size :]))
        raw = (
            attrs.get(IFA_LOCAL, attrs.get(IFA_ADDRESS))
            if family == socket.AF_INET
            else attrs.get(IFA_ADDRESS)
        )
        if raw is not None and family in (socket.AF_INET, socket.AF_INET6):
            found.append(str(ipaddress.ip_address(raw)))
    return found


def replace_address(address: str, prefix: int, interface: str) -> None:
    """``ip address replace <address>/<prefix> dev <interface>``."""
    ip = ipaddress.ip_address(address)
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    body = _IFADDR.pack(family, prefix, 0, 0, socket.if_nametoindex(interface))
    body += _attribute(IFA_LOCAL, ip.packed) + _attribute(IFA_ADDRESS, ip.packed)
    _request(RTM_NEWADDR, NLM_F_CREATE | NLM_F_REPLACE, body)


def has_mark_rule(family: str, mark: int, table: int) -> bool:
    """Whether ``fwmark <mark> lookup <table>`` is among the family's policy rules."""
    return any(True for _ in _mark_rules(family, mark, table))


def add_mark_rule(
    family: str,
    mark: int,
    table: int,
    *,
    mask: int | None = None,
    priority: int | None = None,
    exclusive: bool = False,
) -> None:
    """``ip rule add fwmark <mark>[/<mask>] [pref <priority>] lookup <table>`` (without a priority the
    kernel picks one, as ``ip`` lets it); ``exclusive``: FileExistsError when the same rule is there."""
    flags = NLM_F_CREATE | (NLM_F_EXCL if exclusive else 0)
    _request(RTM_NEWRULE, flags, mark_rule(family, mark, table, mask=mask, priority=priority))


def delete_mark_rule(
    family: str, mark: int, table: int, *, mask: int | None = None, priority: int | None = None
) -> None:
    """``ip rule del`` of exactly that rule; FileNotFoundError-style OSError (ENOENT) when it is not there."""
    _request(RTM_DELRULE, 0, mark_rule(family, mark, table, mask=mask, priority=priority))


def mark_rule(
    family: str, mark: int, table: int, *, mask: int | None = None, priority: int | None = None
) -> bytes:
    """The ``fib_rule_hdr`` and attributes of ``fwmark <mark>[/<mask>] [pref <priority>] lookup <table>``."""
    body = _RTMSG.pack(_FAMILIES[family], 0, 0, 0, _header_table(table), 0, 0, FR_ACT_TO_TBL, 0)
    if priority is not None:
        body += _attribute(FRA_PRIORITY, _U32.pack(priority))
    body += _attribute(FRA_FWMARK, _U32.pack(mark))
    if mask is not None:
        body += _attribute(FRA_FWMASK, _U32.pack(mask))
    return body + _attribute(FRA_TABLE, _U32.pack(table))


def delete_mark_rules(family: str, mark: int, table: int) -> int:
    """Delete every ``fwmark <mark> lookup <table>`` rule of the family; how many there were."""
    rules = list(_mark_rules(family, mark, table))
    for payload in rules:
        _request(RTM_DELRULE, 0, payload)
    return len(rules)


def replace_local_default_route(family: str, table: int, interface: str) -> None:
    """``ip route replace local default dev <interface> table <table>``."""
    _request(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_REPLACE, _local_default_route(family, table, interface))


def delete_local_default_route(family: str, table: int, interface: str) -> None:
    """``ip route del local default dev <interface> table <table>``; OSError (ESRCH) when it is not there."""
    _request(RTM_DELROUTE, 0, _local_default_route(family, table, interface))


def _local_default_route(family: str, table: int, interface: str) -> bytes:
    body = _RTMSG.pack(
        _FAMILIES[family], 0, 0, 0, _header_table(table), RTPROT_BOOT, RT_SCOPE_HOST, RTN_LOCAL, 0
    )
    body += _attribute(RTA_OIF, _U32.pack(socket.if_nametoindex(interface)))
    return body + _attribute(RTA_TABLE, _U32.pack(table))


def flush_table(family: str, table: int) -> None:
    """``ip route flush table <table>``: every route of the family in that table."""
    header = _RTMSG.pack(_FAMILIES[family], 0, 0, 0, 0, 0, 0, 0, 0)
    dumped = _dump(RTM_GETROUTE, header)
    routes = [payload for kind, payload in dumped if kind == RTM_NEWROUTE and _table_of(payload) == table]
    for payload in routes:
        _request(RTM_DELROUTE, 0, payload)


def _mark_rules(family: str, mark: int, table: int) -> Iterator[bytes]:
    header = _RTMSG.pack(_FAMILIES[family], 0, 0, 0, 0, 0, 0, 0, 0)
    for kind, payload in _dump(RTM_GETRULE, header):
        fwmark = dict(_attributes(payload[_RTMSG.size :])).get(FRA_FWMARK)
        if kind != RTM_NEWRULE or payload[7] != FR_ACT_TO_TBL or fwmark is None:
            continue
        if _U32.unpack(fwmark[:4])[0] == mark and _table_of(payload) == table:
            yield payload


def _header_table(table: int) -> int:
    """The header's 8-bit table: the table itself when it fits, else unspecified (the attribute says)."""
    return table if table < 256 else 0


def _table_of(payload: bytes) -> int:
    """A route's or rule's table: the 32-bit attribute when present, else the header's byte."""
    attrs = dict(_attributes(payload[_RTMSG.size :]))
    if RTA_TABLE in attrs:
        return int(_U32.unpack(attrs[RTA_TABLE][:4])[0])
    return payload[4]


def _attribute(kind: int, value: bytes) -> bytes:
    length = _ATTR.size + len(value)
    return _ATTR.pack(length, kind) + value + b"\0" * (-length % 4)


def _attributes(data: bytes) -> Iterator[tuple[int, bytes]]:
    offset = 0
    while offset + _ATTR.size <= len(data):
        length, kind = _ATTR.unpack_from(data, offset)
        if length < _ATTR.size:
            return
        yield kind & 0x7FFF, data[offset + _ATTR.size : offset + length]
        offset += (length + 3) & ~3


def _socket() -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
    sock.settimeout(5.0)  # the kernel answers at once; a bound, not a wait
    return sock


def _messages(sock: socket.socket) -> Iterator[tuple[int, bytes]]:
    """The messages of one answer, up to its end (DONE, or the ACK/error of a single request)."""
    while True:
        data = sock.recv(1 << 16)
        offset = 0
        while offset + _HEADER.size <= len(data):
            length, kind, _flags, _seq, _port = _HEADER.unpack_from(data, offset)
            payload = data[offset + _HEADER.size : offset + length]
            offset += (length + 3) & ~3
            if kind == NLMSG_DONE:
                return
            if kind == NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", payload)
                if code:
                    raise OSError(-code, os.strerror(-code))
                return  # an ACK
            yield kind, payload


def _dump(kind: int, body: bytes) -> list[tuple[int, bytes]]:
    with _socket() as sock:
        sock.send(_HEADER.pack(_HEADER.size + len(body), kind, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + body)
        return list(_messages(sock))


def _request(kind: int, flags: int, body: bytes) -> None:
    with _socket() as sock:
        message = _HEADER.pack(_HEADER.size + len(body), kind, NLM_F_REQUEST | NLM_F_ACK | flags, 1, 0)
        sock.send(message + body)
        for _ in _messages(sock):
            pass
