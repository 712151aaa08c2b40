"""bench.dns judges issue 23's forwarding goals against dnsmasq as forwarder, round by round."""

from __future__ import annotations

import socket
import threading

import dns.message

from bench.dns import (
    DIRECT,
    DNSMASQ_FORWARDER,
    FORWARD,
    YARDSTICK,
    Bench,
    DnsperfResult,
    Row,
    _slices_merged,
    forwarding_goals,
    start_yardstick,
)
from tests.fixtures.dnsmasq import DnsAddress


def result(p50_us: float = 0.0, cpu_us: float = 0.0, queries: int = 1000) -> DnsperfResult:
    return DnsperfResult(
        latencies=[p50_us / 1e6] * 3, completed=queries, server_cpu=cpu_us * queries / 1e6, qps=queries
    )


def bench_with(rounds: list[dict[str, tuple[float, float]]]) -> Bench:
    """Each round: target -> (p50 at the fixed rate in µs, CPU per query at unlimited rate in µs)."""
    bench = Bench(seconds=1, rate=1000, rounds=len(rounds))
    for number, targets in enumerate(rounds, start=1):
        suffix = "" if number == 1 else f", round {number}"
        for target, (p50, cpu) in targets.items():
            bench.rows.append(Row(FORWARD, target, "unlimited" + suffix, result(cpu_us=cpu)))
            bench.rows.append(Row(FORWARD, target, "1,000 q/s" + suffix, result(p50_us=p50)))
    return bench


def round_(
    direct: float, dnsmasq: float, agent: float, dnsmasq_cpu: float, agent_cpu: float
) -> dict[str, tuple[float, float]]:
    return {DIRECT: (direct, 3.0), DNSMASQ_FORWARDER: (dnsmasq, dnsmasq_cpu), "agent": (agent, agent_cpu)}


def test_the_ratios_are_taken_per_round_and_judged_on_the_median() -> None:
    bench = bench_with(
        [
            round_(direct=30, dnsmasq=80, agent=100, dnsmasq_cpu=10, agent_cpu=19),  # 1.4x, 1.9x
            round_(direct=40, dnsmasq=80, agent=140, dnsmasq_cpu=10, agent_cpu=25),  # 2.5x, 2.5x
            round_(direct=20, dnsmasq=70, agent=80, dnsmasq_cpu=12, agent_cpu=18),  # 1.2x, 1.5x
        ]
    )
    latency, cpu = forwarding_goals(bench)
    assert "= 1.40x" in latency and "1.20-2.50x" in latency and "goal <= 1.5x" in latency
    assert latency.endswith("MET") and "NOT MET" not in latency
    assert "= 1.90x" in cpu and "goal <= 2.0x" in cpu and cpu.endswith("MET") and "NOT MET" not in cpu


def test_a_goal_missed_says_not_met() -> None:
    bench = bench_with([round_(direct=30, dnsmasq=60, agent=120, dnsmasq_cpu=10, agent_cpu=30)])
    latency, cpu = forwarding_goals(bench)
    assert "= 3.00x" in latency and latency.endswith("NOT MET")
    assert "= 3.00x" in cpu and cpu.endswith("NOT MET")


def test_without_the_forwarding_rows_nothing_is_judged() -> None:
    assert all("not measured" in line for line in forwarding_goals(Bench(seconds=1, rate=1000)))


def test_the_latency_slices_of_a_target_print_as_one_row_of_all_their_queries() -> None:
    bench = bench_with(
        [
            round_(direct=30, dnsmasq=80, agent=100, dnsmasq_cpu=10, agent_cpu=19),
            round_(direct=40, dnsmasq=80, agent=140, dnsmasq_cpu=10, agent_cpu=25),
        ]
    )
    rows = [row for row in _slices_merged(bench) if row.load.startswith("1,000 q/s")]
    assert [(row.target, row.load) for row in rows] == [
        (target, "1,000 q/s, 2 slices") for target in (DIRECT, DNSMASQ_FORWARDER, "agent")
    ]
    assert (
        rows[2].result is not None and rows[2].result.completed == 2000 and len(rows[2].result.latencies) == 6
    )


def test_the_yardstick_forwarder_is_compared_with_the_agent_slice_by_slice() -> None:
    bench = bench_with(
        [
            round_(direct=30, dnsmasq=80, agent=100, dnsmasq_cpu=10, agent_cpu=19),
            round_(direct=40, dnsmasq=80, agent=140, dnsmasq_cpu=10, agent_cpu=25),
            round_(direct=20, dnsmasq=70, agent=80, dnsmasq_cpu=12, agent_cpu=18),
        ]
    )
    for number, p50 in enumerate((90, 110, 75), start=1):  # agent minus yardstick: 10, 30, 5
        bench.rows.append(
            Row(FORWARD, YARDSTICK, "1,000 q/s" + ("" if number == 1 else f", round {number}"), result(p50))
        )
    *_, yardstick = forwarding_goals(bench)
    assert YARDSTICK in yardstick and "agent - yardstick = 10 µs" in yardstick
    assert "5-30 µs" in yardstick and "no goal" in yardstick


def test_without_yardstick_rows_there_is_no_yardstick_line() -> None:
    bench = bench_with([round_(direct=30, dnsmasq=80, agent=100, dnsmasq_cpu=10, agent_cpu=19)])
    assert not any(YARDSTICK in line for line in forwarding_goals(bench))


def test_the_yardstick_forwarder_relays_a_query_and_its_reply() -> None:
    upstream = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    upstream.bind(("127.0.0.1", 0))
    upstream.settimeout(10)

    def answer_one() -> None:
        data, peer = upstream.recvfrom(4096)
        upstream.sendto(dns.message.make_response(dns.message.from_wire(data)).to_wire(), peer)

    responder = threading.Thread(target=answer_one, daemon=True)
    responder.start()
    process, address_ = start_yardstick(DnsAddress(*upstream.getsockname()))
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            client.settimeout(10)
            query = dns.message.make_query("relayed.example.", "A", id=0x1234)
            client.sendto(query.to_wire(), (address_.host, address_.port))
            reply = dns.message.from_wire(client.recv(4096))
        assert reply.id == 0x1234 and reply.question == query.question
    finally:
        process.terminate()
        process.wait(10)
        upstream.close()
        responder.join(10)
