"""The address probes come from: 127.0.0.6 (``::6``), the source Envoy's inbound passthrough uses.

Istio sends probes from there (``UpstreamLocalAddressIPv4`` in ``pilot/cmd/pilot-agent/status``)
so that a capturing sidecar recognises them and does not capture them again. Where that address
cannot reach the destination (a pod IP not routed via loopback, or ``::6`` not configured on the
host), the probe is made again from the default source, and later probes start there.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable
from typing import TypeVar

from istio_agent.log import scope

log = scope("healthcheck")

SOURCE_IPV4 = "127.0.0.6"
SOURCE_IPV6 = "::6"
# connect() errors that mean "this source address cannot reach that destination", as opposed to
# the application not listening.
_UNREACHABLE_FROM_SOURCE = frozenset({errno.EINVAL, errno.EADDRNOTAVAIL, errno.ENETUNREACH})
_T = TypeVar("_T")


class ProbeSource:
    """Binds probe sockets to 127.0.0.6 / ::6 while that works, and leaves them unbound once it does not."""

    def __init__(self) -> None:
        self._disabled: set[int] = set()

    def active(self, family: int) -> bool:
        """Whether sockets of ``family`` are still bound to the probe source address."""
        return family in (socket.AF_INET, socket.AF_INET6) and family not in self._disabled

    def disable(self, family: int, reason: OSError) -> None:
        if family in self._disabled:
            return
        self._disabled.add(family)
        address = SOURCE_IPV4 if family == socket.AF_INET else SOURCE_IPV6
        log.debug("probe source address %s unusable (%s), using the default source", address, reason.strerror)

    def open_socket(self, family: int, kind: int = socket.SOCK_STREAM, proto: int = 0) -> socket.socket:
        """A probe socket with SO_LINGER 1 s, bound to the probe source address when usable.

        This is the ``SocketFactory`` the HTTP clients and ``dial.connect`` take.
        """
        sock = socket.socket(family, kind, proto)
        try:
            # As Istio: bounded lingering, so a closed probe connection does not linger for long.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 1))
            if self.active(family):
                address = SOURCE_IPV4 if family == socket.AF_INET else SOURCE_IPV6
                try:
                    sock.bind((address, 0))
                except OSError as err:
                    self.disable(family, err)
        except BaseException:
            sock.close()
            raise
        return sock

    async def dial(self, host: str, attempt: Callable[[], Awaitable[_T]]) -> _T:
        """Run ``attempt`` (which dials ``host`` with ``open_socket``); when the probe source cannot
        reach ``host``, stop using it for ``host``'s address families and run ``attempt`` again.

        Any other error, a TLS one included, is the attempt's own and is raised as it is.
        """
        families = _families(host)
        try:
            return await attempt()
        except OSError as err:
            if (
                isinstance(err, ssl.SSLError)
                or err.errno not in _UNREACHABLE_FROM_SOURCE
                or not any(self.active(family) for family in families)
            ):
                raise
            for family in families:
                self.disable(family, err)
        return await attempt()


def _families(host: str) -> list[int]:
    """Address families a destination may resolve to (both for a name)."""
    try:
        return [socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET]
    except ValueError:
        return [socket.AF_INET, socket.AF_INET6]
