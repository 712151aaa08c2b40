"""Where a forwarded DNS query's latency goes in Python: the agent's two legs against the yardstick's.

    python -m bench.dns_legs [--rounds 6] [--seconds 3] [--rate 1000] [--baseline-src DIR]

``bench.dns`` judges the forwarding goal with dnsperf, whose p50 moves by 5-10 µs between two
processes of one build: a change worth a few microseconds cannot be seen there. This measures the
agent's own share directly. Each server runs in its own process with its sockets made by a
``socket.socket`` subclass that notes the time of four calls, and reports, per forwarded query:

* **query leg**: from the listener's ``recvfrom`` (the client's query) to the ``send`` to the
  upstream, the system call's own time included;
* **reply leg**: from the upstream socket's ``recv`` to the ``sendto`` back to the client.

Everything between those calls is the server's Python on the latency path; bookkeeping after the
``send``/``sendto`` is not counted (it overlaps the other side's work). The servers: the agent's DNS
proxy (``DnsServer`` with one upstream, as a pod's resolv.conf has) of this build and, with
``--baseline-src``, of another build's ``src``; and the **yardstick**, ``bench.dns``'s minimal
Python forwarder, the floor for Python on the same loop. They take turns for ``--rounds`` rounds of
dnsperf at ``--rate`` queries/s for ``--seconds`` each against one dnsmasq upstream (the upstream-only
names of ``bench.dns``); each figure is the median over the rounds of each round's p50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.dns import address, run_dnsperf, upstream_name, warm_up, write_datafile
from istio_agent.ctl.local import free_port
from tests.fixtures.dnsmasq import DnsAddress, start_dnsmasq, write_hosts

NAMES = 1000


def _timed_sockets() -> tuple[list[int], list[int]]:
    """Make every socket made from now on note the time of its calls; the two legs' samples (ns)."""
    clock = time.perf_counter_ns
    received = {"query": 0, "reply": 0}
    query_leg: list[int] = []
    reply_leg: list[int] = []

    class TimedSocket(socket.socket):
        __slots__ = ()

        def recvfrom(self, *args):  # type: ignore[no-untyped-def]
            received["query"] = clock()
            return super().recvfrom(*args)

        def recv(self, *args):  # type: ignore[no-untyped-def]
            received["reply"] = clock()
            return super().recv(*args)

        def send(self, *args):  # type: ignore[no-untyped-def]
            query_leg.append(clock() - received["query"])
            return super().send(*args)

        def sendto(self, *args):  # type: ignore[no-untyped-def]
            reply_leg.append(clock() - received["reply"])
            return super().sendto(*args)

    socket.socket = TimedSocket  # type: ignore[misc]
    return query_leg, reply_leg


def _report(query_leg: list[int], reply_leg: list[int]) -> None:
    """The legs' p50 in µs, the first fifth of the samples left out (warm-up)."""
    legs = {}
    for name, samples in (("query", query_leg), ("reply", reply_leg)):
        kept = samples[len(samples) // 5 :]
        legs[name] = statistics.median(kept) / 1000 if kept else None
    print(json.dumps(legs), flush=True)


def serve(kind: str, upstream: tuple[str, int], port: int) -> None:
    """A server of ``kind`` (agent, yardstick) on 127.0.0.1:``port`` until SIGTERM, then its legs."""
    legs = _timed_sockets()
    if kind == "yardstick":
        signal.signal(signal.SIGTERM, lambda *_: (_report(*legs), os._exit(0)))
        from bench.dns import serve_yardstick

        serve_yardstick(DnsAddress(*upstream), port)
        return

    from istio_agent.cli.runtime import run as run_loop
    from istio_agent.dns.server import DnsResolver, DnsServer
    from istio_agent.dns.table import LookupTable
    from istio_agent.dns.upstream import Forwarder
    from istio_agent.metrics import Registry
    from istio_agent.protos import nds_pb2

    async def agent() -> None:
        registry = Registry()
        resolver = DnsResolver(Forwarder([upstream], timeout=5.0, registry=registry))
        resolver.table = LookupTable.build(
            nds_pb2.NameTable(), proxy_namespace="ns1", proxy_domain="svc.cluster.local", search_domains=()
        )
        server = DnsServer(resolver, [("127.0.0.1", port)], registry=registry)
        await server.start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        print("ready", flush=True)
        await stop.wait()
        _report(*legs)

    run_loop(agent())


def measure(
    kind: str, src: str | None, upstream: DnsAddress, datafile: Path, seconds: float, rate: int
) -> dict[str, float | None]:
    port = free_port()
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src
    command = [sys.executable, "-m", "bench.dns_legs", "--serve", kind, upstream.host, str(upstream.port)]
    process = subprocess.Popen([*command, str(port)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout is not None
        if process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {kind} server did not start")
        target = DnsAddress("127.0.0.1", port)
        warm_up(target, datafile)
        run_dnsperf(target, datafile, seconds, rate, process.pid)
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--baseline-src", help="another build's src directory, measured in turn")
    parser.add_argument(
        "--serve", nargs=4, metavar=("KIND", "HOST", "PORT", "LISTEN"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.serve:
        kind, host, up_port, listen = args.serve
        serve(kind, (host, int(up_port)), int(listen))
        return

    base = Path(tempfile.mkdtemp(prefix="bench-dns-legs-"))
    names = [upstream_name(i) for i in range(NAMES)]
    hosts = write_hosts(base / "upstream.hosts", [(name, address(128, i)) for i, name in enumerate(names)])
    datafile = write_datafile(base / "queries.txt", names)
    upstream = start_dnsmasq(hosts, port=53, log=base / "upstream.log")
    servers: list[tuple[str, str, str | None]] = [("agent, this build", "agent", None)]
    if args.baseline_src:
        servers.append((f"agent, {args.baseline_src}", "agent", args.baseline_src))
    servers.append(("yardstick", "yardstick", None))
    legs: dict[str, dict[str, list[float]]] = {label: {"query": [], "reply": []} for label, _, _ in servers}
    try:
        for round_ in range(args.rounds):
            order = servers[round_ % len(servers) :] + servers[: round_ % len(servers)]
            for label, kind, src in order:
                for leg, value in measure(
                    kind, src, upstream.address, datafile, args.seconds, args.rate
                ).items():
                    if value is not None:
                        legs[label][leg].append(value)
    finally:
        upstream.process.terminate()
        upstream.process.wait()
    print(
        f"Python time on a forwarded query's latency path, {args.rate} q/s, median of {args.rounds} rounds' p50:"
    )
    print("| server | query leg | reply leg | both |")
    print("|---|---:|---:|---:|")
    for label, by_leg in legs.items():
        query, reply = (
            statistics.median(by_leg[leg]) if by_leg[leg] else float("nan") for leg in ("query", "reply")
        )
        print(f"| {label} | {query:.1f} µs | {reply:.1f} µs | {query + reply:.1f} µs |")


if __name__ == "__main__":
    main()
