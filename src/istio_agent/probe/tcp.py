"""The ``tcpSocket`` check: a TCP connection to the application opens (from the probe source)."""

from __future__ import annotations

from istio_agent.http import dial
from istio_agent.probe.source import ProbeSource


def host_port(host: str, port: int) -> str:
    """``host:port`` as Go's ``net.JoinHostPort`` writes it (an IPv6 literal in brackets, once)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


async def connect(source: ProbeSource, host: str, port: int) -> None:
    """Open a connection to ``host:port`` and close it at once.

    Raises the ``OSError`` of the last address tried (``socket.gaierror`` when ``host`` does not
    resolve); the caller bounds the time with ``asyncio.timeout``.
    """
    sock = await source.dial(host, lambda: dial.connect(host, port, source.open_socket))
    sock.close()
