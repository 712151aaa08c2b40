"""A listening TCP socket, bound before the server that will serve it is even imported.

The kernel queues connections on a listening socket at once, so a port bound this way answers
(after a short wait in the backlog) from the moment it is bound, however long loading the server
takes; the agent binds its status port like this, first of all, and serves it at once.
"""

from __future__ import annotations

import socket


def listening_socket(host: str, port: int, *, backlog: int = 128) -> socket.socket:
    """A bound, listening, non-blocking socket on an IP ``host``; its OSError names the address."""
    address = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"cannot listen on {host}:{port}: {err.strerror}") from None
    return sock
