"""A tiny client/listener run inside a test namespace, as a given uid (stdlib only, any python3).

    listen tcp PORT      print "ready", accept one connection, print "accepted <orig-ip> <orig-port>"
    listen udp PORT      print "ready", receive one datagram, print "received <payload>"
    listen tproxy PORT   as tcp, on a transparent socket (IP_TRANSPARENT, as Envoy in TPROXY mode):
                         the accepted connection's local address is the original destination
    connect tcp HOST PORT    print "connected" or "failed <error>"
    send udp HOST PORT TEXT  send one datagram

Run as uid 1337 it must be the system interpreter (/usr/bin/python3): a uid without access to a
0700 home cannot exec a virtualenv's interpreter that lives there.
"""

from __future__ import annotations

import socket
import struct
import sys

SO_ORIGINAL_DST = 80
IP_TRANSPARENT = 19
TIMEOUT = 3.0


def original_dst(conn: socket.socket) -> tuple[str, int]:
    """Where the client meant to connect before REDIRECT rewrote it (netfilter's SO_ORIGINAL_DST);
    without conntrack in this namespace (nothing redirected) the address it reached."""
    try:
        raw = conn.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    except OSError:
        return conn.getsockname()
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), port


def main(argv: list[str]) -> None:
    verb, proto, *rest = argv
    if verb == "listen":
        kind = socket.SOCK_DGRAM if proto == "udp" else socket.SOCK_STREAM
        server = socket.socket(socket.AF_INET, kind)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if proto == "tproxy":
            server.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
        server.bind(("0.0.0.0", int(rest[0])))
        server.settimeout(TIMEOUT)
        if kind == socket.SOCK_STREAM:
            server.listen(1)
        print("ready", flush=True)
        try:
            if kind == socket.SOCK_STREAM:
                conn, _ = server.accept()
                print("accepted {} {}".format(*original_dst(conn)), flush=True)
            else:
                print(f"received {server.recv(512).decode()}", flush=True)
        except TimeoutError:
            print("timeout", flush=True)
        return
    host, port = rest[0], int(rest[1])
    if verb == "connect":
        try:
            socket.create_connection((host, port), timeout=TIMEOUT).close()
            print("connected", flush=True)
        except OSError as err:
            print(f"failed {err}", flush=True)
        return
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(rest[2].encode(), (host, port))


if __name__ == "__main__":
    main(sys.argv[1:])
