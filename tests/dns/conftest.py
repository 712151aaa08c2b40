"""DNS test fixtures: a real dnsmasq as the upstream resolver the agent forwards to.

``dnsmasq_upstream`` serves UPSTREAM_HOSTS (+ UPSTREAM_TXT, UPSTREAM_CNAMES) and answers NXDOMAIN
for every other name. As root it listens on port 53 of a spare 127.0.0.N, so a resolv.conf
(which carries no port) can name it: ``upstream_resolv_conf`` writes that file. ``start_dnsmasq``
is the factory behind both, for tests that need their own records or must stop the upstream.
Tests using these skip when dnsmasq is not installed (``make`` installs it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import pytest

from istio_agent.ctl.local import free_port
from tests.fixtures.dnsmasq import (
    DnsAddress,
    Dnsmasq,
    DnsmasqNotFound,
    DnsmasqOptions,
    find_dnsmasq,
    start_dnsmasq,
    write_hosts,
)

MANY_NAME = "many.upstream.test"
MANY_COUNT = 60
"""A name with 60 A records: 60 * 16 bytes of answers, well over 512 bytes (truncation tests)."""

UPSTREAM_HOSTS: dict[str, list[str]] = {
    "www.upstream.test": ["192.0.2.10"],
    "dual.upstream.test": ["192.0.2.11", "2001:db8::11"],
    "v6only.upstream.test": ["2001:db8::12"],
    MANY_NAME: [f"198.51.100.{i}" for i in range(1, MANY_COUNT + 1)],
}
UPSTREAM_TXT: dict[str, list[str]] = {"txt.upstream.test": ["v=upstream", "second string"]}
UPSTREAM_CNAMES: dict[str, str] = {"alias.upstream.test": "www.upstream.test"}


class StartDnsmasq(Protocol):
    def __call__(
        self,
        hosts: Mapping[str, Sequence[str]],
        *,
        host: str | None = None,
        port: int | None = None,
        options: DnsmasqOptions | None = None,
    ) -> Dnsmasq: ...


@pytest.fixture
def start_dnsmasq_factory(tmp_path: Path) -> Iterator[StartDnsmasq]:
    """``start(hosts, *, host=None, port=None, options=None) -> Dnsmasq``, stopped at teardown.

    ``hosts`` is ``{name: [ip, ...]}``. Without ``host``/``port``: port 53 of a spare 127.0.0.N as
    root, else a free port on 127.0.0.1 (then no resolv.conf can reach it).
    """
    if find_dnsmasq() is None:
        pytest.skip("dnsmasq is not installed (Debian package dnsmasq-base; `make` installs it)")
    started: list[Dnsmasq] = []

    def start(
        hosts: Mapping[str, Sequence[str]],
        *,
        host: str | None = None,
        port: int | None = None,
        options: DnsmasqOptions | None = None,
    ) -> Dnsmasq:
        index = len(started)
        hosts_file = write_hosts(tmp_path / f"dnsmasq-{index}.hosts", hosts)
        if port is None:
            if os.geteuid() == 0:
                port = 53
            else:
                host, port = host or "127.0.0.1", free_port()
        try:
            server = start_dnsmasq(
                hosts_file,
                host,
                port,
                options,
                log=tmp_path / f"dnsmasq-{index}.log",
            )
        except DnsmasqNotFound as err:
            pytest.skip(str(err))
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in reversed(started):
            server.stop()


@pytest.fixture
def dnsmasq_upstream(start_dnsmasq_factory: StartDnsmasq) -> DnsAddress:
    """(host, port) of a running dnsmasq serving UPSTREAM_HOSTS, UPSTREAM_TXT and UPSTREAM_CNAMES."""
    options = DnsmasqOptions(txt_records=UPSTREAM_TXT, cnames=UPSTREAM_CNAMES)
    server = start_dnsmasq_factory(UPSTREAM_HOSTS, options=options)
    return server.address


@pytest.fixture
def upstream_resolv_conf(dnsmasq_upstream: DnsAddress, tmp_path: Path) -> Path:
    """A resolv.conf naming ``dnsmasq_upstream`` (for ISTIO_AGENT_RESOLV_CONF); skips unless it is on port 53."""
    host, port = dnsmasq_upstream
    if port != 53:
        pytest.skip("the upstream must listen on port 53 to be named in resolv.conf (run as root)")
    path = tmp_path / "resolv.conf"
    path.write_text(f"nameserver {host}\n")
    return path
