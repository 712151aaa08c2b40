"""istio-validation: prove that the pod's traffic is captured before the app starts.

As ``tools/istio-iptables/pkg/validation/validator.go``: listen where the proxy would
(127.0.0.1, ``::1`` for an IPv6 pod, on the outbound and inbound capture ports), connect to
127.0.0.6:<probe port> (``::6`` for an IPv6 pod) and pass once a listener accepts a connection
whose original destination port is the probe port. The container runs as the proxy's uid, whose
loopback traffic the rules send to the inbound capture port; without rules the connection is
simply refused, and after the timeout the container exits 126, the code the repair controller
looks for.
"""

from __future__ import annotations

import selectors
import socket
import struct
import time
from dataclasses import dataclass

from istio_agent.log import scope

log = scope("validation")
EXIT_FAILED = 126
SO_ORIGINAL_DST = 80
"""netfilter's getsockopt for the pre-NAT destination (IPv4 at SOL_IP, IPv6 at IPPROTO_IPV6)."""
RETRY_SECONDS = 0.1


@dataclass(frozen=True)
class Probe:
    """Where to listen and what to dial; defaults are istio-iptables'."""

    proxy_port: int = 15001
    inbound_capture_port: int = 15006
    probe_port: int = 15002
    timeout: float = 5.0
    ipv6: bool = False

    @property
    def listen_ip(self) -> str:
        # REDIRECT sends a locally made connection to the loopback's primary address: ::1, not ::6
        return "::1" if self.ipv6 else "127.0.0.1"

    @property
    def dial_ip(self) -> str:
        return "::6" if self.ipv6 else "127.0.0.6"


def original_port(conn: socket.socket, ipv6: bool) -> int | None:
    """The port the client dialled before REDIRECT, or None when the connection was not NATed."""
    try:
        if ipv6:
            raw = conn.getsockopt(socket.IPPROTO_IPV6, SO_ORIGINAL_DST, 28)
        else:
            raw = conn.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    except OSError:
        return None
    port: int = struct.unpack_from("!2xH", raw)[0]
    return port


def validate(probe: Probe) -> bool:
    """True once a dialled connection reaches a listener with the probe port as original destination."""
    family = socket.AF_INET6 if probe.ipv6 else socket.AF_INET
    selector = selectors.DefaultSelector()
    listeners = []
    try:
        for port in (probe.proxy_port, probe.inbound_capture_port):
            listener = socket.socket(family, socket.SOCK_STREAM)
            listeners.append(listener)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((probe.listen_ip, port))
            listener.listen(8)
            listener.setblocking(False)
            selector.register(listener, selectors.EVENT_READ)
        return _dial_until_seen(probe, family, selector)
    except OSError as err:
        log.error("validation could not listen on %s: %s", probe.listen_ip, err)
        return False
    finally:
        selector.close()
        for listener in listeners:
            listener.close()


def _dial_until_seen(probe: Probe, family: int, selector: selectors.BaseSelector) -> bool:
    end = time.monotonic() + probe.timeout
    while (left := end - time.monotonic()) > 0:
        with socket.socket(family, socket.SOCK_STREAM) as client:
            if probe.ipv6:
                # as an app's connection: from ::1. Left to the kernel, a dial to ::6 (an address on
                # lo) leaves from ::6, which the rules return uncaptured (Envoy's own source address)
                client.bind(("::1", 0))
            client.setblocking(False)
            client.connect_ex((probe.dial_ip, probe.probe_port))
            # a refused dial shows as no listener ready: the select is also the pause between tries
            for key, _ in selector.select(min(RETRY_SECONDS, left)):
                listener = key.fileobj
                assert isinstance(listener, socket.socket)
                conn, _ = listener.accept()
                with conn:
                    port = original_port(conn, probe.ipv6)
                if port == probe.probe_port:
                    log.info("validation passed: the connection to %s:%d was captured", probe.dial_ip, port)
                    return True
    log.error(
        "validation failed: no connection to %s:%d was captured within %gs",
        probe.dial_ip,
        probe.probe_port,
        probe.timeout,
    )
    return False
