"""resolv.conf: the upstream nameservers the DNS proxy forwards to and the search list (Istio: pkg/dns/client/dns.go).

Parsed like the resolver library Istio uses (one nameserver per line, port 53, ``domain`` and
``search`` each replace the search list, ``options`` ignored), with two deliberate differences that
follow glibc, which is what the application in the pod actually uses: comments (``#`` or ``;`` up to
the end of the line) are ignored, and a nameserver that is not an IP address is skipped, because the
application never queries it and resolving it would need DNS.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import NamedTuple

from istio_agent.config.env import ConfigError
from istio_agent.log import scope

log = scope("dns")

DNS_PORT = 53


class ResolvConf(NamedTuple):
    nameservers: tuple[tuple[str, int], ...]
    """(host, 53) in file order; IPv6 hosts unbracketed (``"::1"``, ``"fe80::1%eth0"``)."""
    search: tuple[str, ...]


def _strip_comment(line: str) -> str:
    for marker in ("#", ";"):
        cut = line.find(marker)
        if cut >= 0:
            line = line[:cut]
    return line


def parse_resolv_conf(text: str) -> ResolvConf:
    """Nameservers and search list of a resolv.conf text; never raises, bad lines are skipped."""
    nameservers: list[tuple[str, int]] = []
    search: tuple[str, ...] = ()
    for number, line in enumerate(text.splitlines(), start=1):
        fields = _strip_comment(line).split()
        if not fields:
            continue
        keyword, args = fields[0], fields[1:]
        if keyword == "nameserver":
            if not args:
                continue
            try:
                ipaddress.ip_address(args[0])
            except ValueError:
                log.warning(
                    "resolv.conf line %d: nameserver %r is not an IP address, ignored", number, args[0]
                )
                continue
            nameservers.append((args[0], DNS_PORT))
        elif keyword == "domain":
            search = (args[0],) if args else ()
        elif keyword == "search":
            search = tuple(args)
    return ResolvConf(tuple(nameservers), search)


def read_resolv_conf(path: Path) -> ResolvConf:
    """Parse the file at ``path``; an unreadable file is a ConfigError (the agent cannot start DNS)."""
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as err:
        raise ConfigError(f"cannot read resolv.conf {path}: {err.strerror or err}") from None
    return parse_resolv_conf(text)
