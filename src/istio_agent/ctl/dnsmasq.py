"""A real dnsmasq as a local DNS server: the upstream resolver the DNS tests and benchmark put behind the agent.

The agent's DNS proxy forwards to the nameservers of a resolv.conf, and resolv.conf carries no port,
so an upstream the agent can use listens on port 53 of a spare loopback address (127.0.0.N; we are
root in tests and benchmarks). dnsmasq is started with nothing of its own: no config file, no
/etc/hosts, no upstream (``--no-resolv``), no DHCP, no pid file. It serves only the hosts file it is
given plus a few optional extra records, answers NXDOMAIN for every other name (``--local=/#/``,
so a forwarded miss looks like a real resolver's miss rather than REFUSED), and stays in the
foreground so stopping it is stopping one child process.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, NamedTuple

from istio_agent.dns.client import lookup

DNSMASQ_PATHS = ("/usr/sbin/dnsmasq", "/usr/bin/dnsmasq")
SPARE_FIRST, SPARE_LAST = 100, 250
"""127.0.0.N addresses tried for a spare upstream; clear of 127.0.0.1 and systemd-resolved's .53/.54."""
START_TIMEOUT = 10.0
PROBE_INTERVAL = 0.02


class DnsmasqError(RuntimeError):
    """dnsmasq is missing, would not start, or did not answer; the message says which and why."""


class DnsmasqNotFound(DnsmasqError):
    """No dnsmasq executable on this machine (tests skip on it)."""


class DnsAddress(NamedTuple):
    host: str
    port: int


def find_dnsmasq() -> str | None:
    """The dnsmasq executable (it lives in /usr/sbin, often missing from a non-root PATH), or None."""
    found = shutil.which("dnsmasq")
    if found:
        return found
    return next((path for path in DNSMASQ_PATHS if os.access(path, os.X_OK)), None)


def write_hosts(path: Path, records: Mapping[str, Sequence[str]] | Iterable[tuple[str, str]]) -> Path:
    """Write a hosts file: ``{name: [ip, ...]}`` or ``(name, ip)`` pairs; a name may have many addresses.

    One line per (address, name), which is how dnsmasq gives a name several A/AAAA records
    (e.g. 60 of them, for truncation tests).
    """
    pairs = (
        [(name, ip) for name, ips in records.items() for ip in ips]
        if isinstance(records, Mapping)
        else list(records)
    )
    lines = []
    for name, ip in pairs:
        if not name or any(c.isspace() for c in name) or not ip or any(c.isspace() for c in ip):
            raise ValueError(
                f"hosts entry {name!r} -> {ip!r}: names and addresses cannot be empty or contain spaces"
            )
        lines.append(f"{ip} {name}\n")
    path.write_text("".join(lines))
    return path


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def port_free(host: str, port: int) -> bool:
    """True when both a UDP and a TCP socket can bind ``host:port`` right now."""
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        with socket.socket(_family(host), kind) as sock:
            if kind == socket.SOCK_STREAM:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


def spare_loopback(port: int = 53, exclude: Iterable[str] = ()) -> str:
    """A 127.0.0.N whose ``port`` is free for UDP and TCP (checked with a bind; random N, so parallel
    test runs rarely race for the same one)."""
    skip = set(exclude)
    candidates = [f"127.0.0.{n}" for n in range(SPARE_FIRST, SPARE_LAST + 1)]
    random.shuffle(candidates)
    for host in candidates:
        if host not in skip and port_free(host, port):
            return host
    raise DnsmasqError(f"no loopback address 127.0.0.{SPARE_FIRST}-{SPARE_LAST} has port {port} free")


def query_rcode(host: str, port: int, name: str = "probe.invalid", timeout: float = 0.2) -> int | None:
    """Send one UDP query; the response code of the answer, or None when nothing answered in ``timeout``."""
    answer = lookup(host, port, name, timeout=timeout)
    return None if answer is None else answer.rcode


@dataclass(frozen=True)
class DnsmasqOptions:
    """What dnsmasq serves besides the hosts file, and how.

    ``local_ttl`` is the TTL of the hosts-file answers (dnsmasq's default 0 would make them
    uncacheable); ``local_domains`` are the domains it answers NXDOMAIN for when a name is not in
    its hosts file ("#": every domain; empty: it answers REFUSED, having no upstream);
    ``txt_records`` and ``cnames`` add records (a CNAME target must be in the hosts file);
    ``extra_args`` go to dnsmasq verbatim.
    """

    txt_records: Mapping[str, Sequence[str]] = field(default_factory=dict)
    cnames: Mapping[str, str] = field(default_factory=dict)
    local_domains: Sequence[str] = ("#",)
    local_ttl: int = 30
    cache_size: int = 1000
    extra_args: Sequence[str] = ()

    def arguments(self) -> list[str]:
        args = [f"--cache-size={self.cache_size}", f"--local-ttl={self.local_ttl}"]
        args += [f"--local=/{domain.strip('.')}/" for domain in self.local_domains]
        for name, texts in self.txt_records.items():
            for text in texts:
                if "," in text or '"' in text or "\n" in text:
                    raise ValueError(
                        f"TXT record for {name!r}: dnsmasq's command line cannot carry , or \" or newlines"
                    )
            args.append(",".join((f"--txt-record={name}", *texts)))
        args += [f"--cname={alias},{target}" for alias, target in self.cnames.items()]
        args += self.extra_args
        return args


class Dnsmasq:
    """One dnsmasq process serving ``hosts_file`` on ``host:port`` (UDP and TCP).

    Use as a context manager (yields its address), or ``start()``/``stop()``. Its log (start-up
    lines and errors; queries are not logged) goes to ``log``, or to an anonymous temporary file.
    """

    def __init__(
        self,
        host: str,
        port: int,
        hosts_file: Path,
        options: DnsmasqOptions | None = None,
        *,
        log: Path | None = None,
        binary: str | None = None,
    ) -> None:
        self.address = DnsAddress(host, port)
        self.hosts_file = Path(hosts_file).absolute()  # dnsmasq chdirs to /
        self.options = options or DnsmasqOptions()
        self.log = log
        self.binary = binary
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    def command(self) -> list[str]:
        binary = self.binary or find_dnsmasq()
        if binary is None:
            raise DnsmasqNotFound(
                "dnsmasq is not installed (Debian package dnsmasq-base; `make` installs it)"
            )
        user = pwd.getpwuid(
            os.getuid()
        ).pw_name  # as root, stay root: the hosts file may sit in a 0700 tmp dir
        group = grp.getgrgid(os.getgid()).gr_name
        return [
            binary,
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            "--no-poll",
            f"--addn-hosts={self.hosts_file}",
            f"--listen-address={self.address.host}",
            "--bind-interfaces",
            f"--port={self.address.port}",
            "--pid-file=",
            "--log-facility=-",
            f"--user={user}",
            f"--group={group}",
            *self.options.arguments(),
        ]

    def start(self, timeout: float = START_TIMEOUT) -> DnsAddress:
        """Spawn dnsmasq and return once it answers a real query (DnsmasqError, with its log, if it will not)."""
        if not self.hosts_file.is_file():
            raise DnsmasqError(f"hosts file {self.hosts_file} does not exist")
        command = self.command()
        # Open for as long as the process runs (closed by stop()), and readable for log_tail().
        self._log_file = self.log.open("a+b") if self.log else tempfile.TemporaryFile()  # noqa: SIM115
        self.process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while (
            time.monotonic() < deadline
        ):  # another process's state: probe it (each probe waits for an answer)
            if self.process.poll() is not None:
                status = self.process.returncode
                tail = self.log_tail()
                self.stop()
                raise DnsmasqError(f"dnsmasq on {self.describe()} exited with status {status}: {tail}")
            if query_rcode(*self.address) is not None:
                return self.address
            with contextlib.suppress(subprocess.TimeoutExpired):  # not listening yet: pause, unless it exits
                self.process.wait(PROBE_INTERVAL)
        tail = self.log_tail()
        self.stop()
        raise DnsmasqError(f"dnsmasq on {self.describe()} did not answer within {timeout:.0f}s: {tail}")

    def describe(self) -> str:
        host, port = self.address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def log_tail(self, lines: int = 5) -> str:
        """The last lines dnsmasq wrote (its start-up errors say exactly what went wrong)."""
        if self._log_file is None:
            return "(no log)"
        try:
            self._log_file.flush()
            self._log_file.seek(0)
            text = self._log_file.read().decode(errors="replace")
        except (OSError, ValueError):
            return "(log unreadable)"
        return " | ".join(text.strip().splitlines()[-lines:]) or "(empty log)"

    def stop(self, timeout: float = 5.0) -> int | None:
        """Terminate dnsmasq (kill it if it lingers); its exit status, None if it never started."""
        status = None
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            status = self.process.returncode
            self.process = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return status

    def __enter__(self) -> DnsAddress:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()


def start_dnsmasq(
    hosts_file: Path,
    host: str | None = None,
    port: int = 53,
    options: DnsmasqOptions | None = None,
    *,
    log: Path | None = None,
    attempts: int = 5,
) -> Dnsmasq:
    """Start dnsmasq on ``host:port``, or on a spare 127.0.0.N when ``host`` is None; the caller stops it.

    With a spare address, losing a bind race to another process (parallel test runs) is retried on
    another address.
    """
    if not Path(hosts_file).is_file():
        raise DnsmasqError(f"hosts file {hosts_file} does not exist")
    tried: list[str] = []
    last: DnsmasqError | None = None
    for _ in range(attempts if host is None else 1):
        address = host if host is not None else spare_loopback(port, exclude=tried)
        tried.append(address)
        server = Dnsmasq(address, port, hosts_file, options, log=log)
        try:
            server.start()
        except DnsmasqNotFound:
            raise
        except DnsmasqError as err:
            last = err
            continue
        return server
    assert last is not None
    raise last
