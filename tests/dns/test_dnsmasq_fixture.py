"""The dnsmasq harness the DNS tests and benchmark stand on: it answers, and it fails clearly."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import dns.flags
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import pytest

from bench.dns import parse_dnsperf, run_dnsperf, write_datafile
from istio_agent.ctl.local import free_port
from istio_agent.dns.client import build_query
from tests.dns.conftest import MANY_COUNT, MANY_NAME, StartDnsmasq
from tests.fixtures.dnsmasq import (
    DnsAddress,
    Dnsmasq,
    DnsmasqError,
    DnsmasqOptions,
    find_dnsmasq,
    query_rcode,
    write_hosts,
)

TIMEOUT = 2.0


def ask(
    server: DnsAddress, name: str, rdtype: str = "A", *, tcp: bool = False, **make: object
) -> dns.message.Message:
    query = dns.message.make_query(name, rdtype, **make)  # type: ignore[arg-type]
    if tcp:
        return dns.query.tcp(query, server.host, port=server.port, timeout=TIMEOUT)
    return dns.query.udp(query, server.host, port=server.port, timeout=TIMEOUT, ignore_trailing=True)


def addresses(response: dns.message.Message) -> set[str]:
    return {item.to_text() for rrset in response.answer for item in rrset if rrset.rdtype in (1, 28)}


@pytest.mark.parametrize("tcp", [False, True], ids=["udp", "tcp"])
def test_upstream_answers_its_records(dnsmasq_upstream: DnsAddress, tcp: bool) -> None:
    answer = ask(dnsmasq_upstream, "www.upstream.test", tcp=tcp)
    assert answer.rcode() == dns.rcode.NOERROR
    assert addresses(answer) == {"192.0.2.10"}
    assert answer.answer[0].ttl == 30  # --local-ttl: answers are cacheable

    assert addresses(ask(dnsmasq_upstream, "dual.upstream.test", "AAAA", tcp=tcp)) == {"2001:db8::11"}
    cname = ask(dnsmasq_upstream, "alias.upstream.test", tcp=tcp)
    assert {rrset.rdtype for rrset in cname.answer} == {dns.rdatatype.CNAME, dns.rdatatype.A}
    txt = ask(dnsmasq_upstream, "txt.upstream.test", "TXT", tcp=tcp)
    assert [s.decode() for s in txt.answer[0][0].strings] == ["v=upstream", "second string"]


def test_upstream_answers_nxdomain_for_unknown_names(dnsmasq_upstream: DnsAddress) -> None:
    assert ask(dnsmasq_upstream, "nope.upstream.test").rcode() == dns.rcode.NXDOMAIN
    assert ask(dnsmasq_upstream, "www.example.org").rcode() == dns.rcode.NXDOMAIN
    nodata = ask(dnsmasq_upstream, "v6only.upstream.test", "A")
    assert nodata.rcode() == dns.rcode.NOERROR and not nodata.answer


def test_big_answer_is_truncated_over_plain_udp_and_whole_over_tcp_and_edns(
    dnsmasq_upstream: DnsAddress,
) -> None:
    plain = ask(dnsmasq_upstream, MANY_NAME)
    assert plain.flags & dns.flags.TC
    assert len(addresses(plain)) < MANY_COUNT
    assert len(addresses(ask(dnsmasq_upstream, MANY_NAME, tcp=True))) == MANY_COUNT
    edns = ask(dnsmasq_upstream, MANY_NAME, use_edns=0, payload=4096)
    assert not edns.flags & dns.flags.TC
    assert len(addresses(edns)) == MANY_COUNT


def test_resolv_conf_names_the_upstream(upstream_resolv_conf: Path, dnsmasq_upstream: DnsAddress) -> None:
    assert upstream_resolv_conf.read_text().split() == ["nameserver", dnsmasq_upstream.host]
    assert dnsmasq_upstream.port == 53


def test_factory_serves_given_records_and_stop_silences_it(start_dnsmasq_factory: StartDnsmasq) -> None:
    server = start_dnsmasq_factory(
        {"svc-1.mesh.test": ["10.9.0.1"]}, options=DnsmasqOptions(local_domains=())
    )
    assert addresses(ask(server.address, "svc-1.mesh.test")) == {"10.9.0.1"}
    assert ask(server.address, "other.test").rcode() == dns.rcode.REFUSED  # no upstream, nothing local
    server.stop()
    assert query_rcode(*server.address, name="svc-1.mesh.test") is None


def test_two_upstreams_get_different_addresses(start_dnsmasq_factory: StartDnsmasq) -> None:
    first = start_dnsmasq_factory({"a.test": ["10.0.0.1"]})
    second = start_dnsmasq_factory({"a.test": ["10.0.0.2"]})
    assert first.address != second.address
    assert addresses(ask(first.address, "a.test")) == {"10.0.0.1"}
    assert addresses(ask(second.address, "a.test")) == {"10.0.0.2"}


def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    if find_dnsmasq() is None:
        pytest.skip("dnsmasq is not installed")
    hosts = write_hosts(tmp_path / "hosts", {"a.test": ["10.0.0.1"]})
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as squatter:
        squatter.bind(("127.0.0.1", port))
        server = Dnsmasq("127.0.0.1", port, hosts)
        with pytest.raises(
            DnsmasqError, match=r"127\.0\.0\.1:\d+ exited with status \d+: .*(in use|listening socket)"
        ):
            server.start()
    assert server.process is None


def test_options_reject_what_the_command_line_cannot_carry(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"TXT record for 'x\.test'"):
        DnsmasqOptions(txt_records={"x.test": ["a,b"]}).arguments()
    with pytest.raises(ValueError, match="cannot be empty or contain spaces"):
        write_hosts(tmp_path / "hosts", [("bad name", "10.0.0.1")])
    with pytest.raises(DnsmasqError, match="does not exist"):
        Dnsmasq("127.0.0.1", 5353, tmp_path / "missing").start()


def test_probe_query_is_well_formed() -> None:
    parsed = dns.message.from_wire(build_query("svc-1.mesh.test.", 28, query_id=7))
    assert parsed.id == 7
    assert parsed.flags & dns.flags.RD
    assert parsed.question[0].to_text() == "svc-1.mesh.test. IN AAAA"


DNSPERF_SAMPLE = """\
[Status] Sending queries (to 127.0.0.53:53)
> NOERROR foo.example A 0.000353
> NXDOMAIN nope.example A 0.000214
> T bar.example A
> NOERROR foo.example A 0.000106
[Status] Testing complete (time limit)
  Queries sent:         4
  Queries completed:    3 (75.00%)
  Queries lost:         1 (25.00%)
  Run time (s):         1.000239
  Queries per second:   2.999283
"""


def test_dnsperf_output_is_parsed() -> None:
    result = parse_dnsperf(DNSPERF_SAMPLE.splitlines(keepends=True))
    assert (result.sent, result.completed, result.lost, result.timeouts) == (4, 3, 1, 1)
    assert result.latencies == [0.000353, 0.000214, 0.000106]
    assert result.rcodes == {"NOERROR": 2, "NXDOMAIN": 1}
    assert result.not_noerror == 1
    assert result.p50_ms == pytest.approx(0.214)
    assert result.p99_ms == pytest.approx(0.353)
    assert result.qps == pytest.approx(2.999283)


def test_dnsperf_against_the_upstream(dnsmasq_upstream: DnsAddress, tmp_path: Path) -> None:
    """The benchmark's measuring path end to end: real dnsperf, per-query latencies, response codes."""
    if shutil.which("dnsperf") is None:
        pytest.skip("dnsperf is not installed")
    datafile = write_datafile(tmp_path / "queries.txt", ["www.upstream.test", "nope.upstream.test"])
    result = run_dnsperf(dnsmasq_upstream, datafile, seconds=1, rate=200)
    assert result.lost == 0
    assert result.completed == len(result.latencies) >= 100
    assert result.rcodes["NOERROR"] > 0 and result.rcodes["NXDOMAIN"] > 0
    assert 0 < result.p50_ms <= result.p99_ms < 1000
