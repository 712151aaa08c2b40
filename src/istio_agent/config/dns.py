"""Settings of the agent's DNS proxy, from Istio's env names plus a few of our own.

Istio reads them in pkg/istio-agent/agent.go and pkg/dns/client/dns.go.

Ours: ``ISTIO_AGENT_RESOLV_CONF`` (which resolv.conf to read), ``DNS_FORWARD_RETRIES`` and
``DNS_CACHE``. Everything else keeps Istio's name, default and meaning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from istio_agent.config.env import ConfigError, Env
from istio_agent.log import scope

log = scope("dns")

DEFAULT_LISTEN_ADDRESS = "localhost:15053"
DEFAULT_RESOLV_CONF = Path("/etc/resolv.conf")
VM_RESOLV_CONF = Path("/var/lib/istio/resolv.conf")
"""Read instead of /etc/resolv.conf when root serves port 53 itself (Docker, VMs without iptables)."""
DEFAULT_FORWARD_TIMEOUT = timedelta(seconds=5)
MAX_FORWARD_TIMEOUT = timedelta(seconds=30)
"""No client waits longer for an answer: glibc caps its resolver timeout at 30 s."""
MAX_FORWARD_RETRIES = 10

_VARIABLES = (
    "ISTIO_META_DNS_CAPTURE",
    "ISTIO_META_ENABLE_DNS_SERVER",
    "DNS_PROXY_ADDR",
    "DNS_FORWARD_PARALLEL",
    "DNS_FORWARD_TIMEOUT",
    "DNS_FORWARD_RETRIES",
    "DNS_CACHE",
    "ISTIO_AGENT_RESOLV_CONF",
    "POD_NAMESPACE",
)


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as Go's net.SplitHostPort; host may be empty. Raises ValueError."""
    if address.startswith("["):
        end = address.find("]")
        if end < 0 or address[end + 1 : end + 2] != ":":
            raise ValueError(f"invalid address {address!r} (expected host:port or [ipv6]:port)")
        host, port = address[1:end], address[end + 2 :]
    else:
        host, sep, port = address.rpartition(":")
        if not sep or ":" in host:
            raise ValueError(f"invalid address {address!r} (expected host:port or [ipv6]:port)")
    if not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise ValueError(f"invalid port in address {address!r}")
    return host, int(port)


def normalise_proxy_domain(domain: str, namespace: str) -> str:
    """Drop the namespace label from the front of the domain (``ns1.svc.cluster.local`` -> ``svc.cluster.local``)."""
    first, _, rest = domain.partition(".")
    return rest if first == namespace else domain


@dataclass(frozen=True)
class DnsSettings:
    enabled: bool = False
    listen_address: str = DEFAULT_LISTEN_ADDRESS
    """``host:port`` as configured; also copied verbatim into node metadata DNS_PROXY_ADDR."""
    resolv_conf: Path = DEFAULT_RESOLV_CONF
    forward_parallel: bool = False
    forward_timeout: float = DEFAULT_FORWARD_TIMEOUT.total_seconds()
    """Seconds, per upstream dial, write and read."""
    forward_retries: int = 0
    """Extra rounds over the upstream list after all failed (0 = Istio's single round)."""
    cache: bool = False
    proxy_namespace: str = ""
    proxy_domain: str = ""
    """Normalised: the proxy namespace label removed from the front (as Istio's DNS server does)."""
    respond_before_sync: bool = False
    """Forward instead of SERVFAIL before the first name table (only when root serves port 53)."""

    @classmethod
    def from_env(
        cls,
        env: Env,
        *,
        proxy_type: str,
        domain: str | None,
        is_root: bool,
        proxy_metadata: Mapping[str, str] | None = None,
        vm_resolv_conf: Path = VM_RESOLV_CONF,
    ) -> DnsSettings:
        """Read the DNS env vars; raise ConfigError naming the variable on any invalid value.

        ``proxy_metadata`` (ProxyConfig ``proxyMetadata``) supplies values the env does not set, as
        the sidecar injector would have turned them into env vars. ``domain`` is the ``--domain`` flag;
        None or empty means ``<POD_NAMESPACE>.svc.cluster.local``.
        """
        metadata = proxy_metadata or {}
        values = Env({name: env.text(name) or metadata.get(name, "") for name in _VARIABLES})

        enabled = (proxy_type == "sidecar" and values.flag("ISTIO_META_DNS_CAPTURE")) or values.flag(
            "ISTIO_META_ENABLE_DNS_SERVER"
        )
        if not enabled:  # nothing below is used: a bad value must not stop an agent that runs no DNS proxy
            return cls(enabled=False, proxy_namespace=values.text("POD_NAMESPACE"))
        listen_address = values.text("DNS_PROXY_ADDR") or DEFAULT_LISTEN_ADDRESS
        try:
            _, port = split_host_port(listen_address)
        except ValueError as err:
            raise ConfigError(f"invalid value for DNS_PROXY_ADDR={listen_address!r}: {err}") from None

        configured_resolv_conf = values.text("ISTIO_AGENT_RESOLV_CONF")
        resolv_conf = Path(configured_resolv_conf) if configured_resolv_conf else DEFAULT_RESOLV_CONF
        respond_before_sync = False
        if port == 53:
            if is_root:
                # /etc/resolv.conf points at the agent itself here; an explicit setting still wins.
                if not configured_resolv_conf and vm_resolv_conf.exists():
                    resolv_conf = vm_resolv_conf
                respond_before_sync = True
            else:
                if enabled:
                    log.error(
                        "DNS_PROXY_ADDR %s needs port 53 but the agent is not root; using %s",
                        listen_address,
                        DEFAULT_LISTEN_ADDRESS,
                    )
                listen_address = DEFAULT_LISTEN_ADDRESS

        timeout = values.duration(
            "DNS_FORWARD_TIMEOUT",
            DEFAULT_FORWARD_TIMEOUT,
            minimum=timedelta(milliseconds=1),
            maximum=MAX_FORWARD_TIMEOUT,
        )
        retries = values.integer("DNS_FORWARD_RETRIES", 0, minimum=0, maximum=MAX_FORWARD_RETRIES)

        namespace = values.text("POD_NAMESPACE")
        return cls(
            enabled=enabled,
            listen_address=listen_address,
            resolv_conf=resolv_conf,
            forward_parallel=values.flag("DNS_FORWARD_PARALLEL"),
            forward_timeout=timeout.total_seconds(),
            forward_retries=retries,
            cache=values.flag("DNS_CACHE"),
            proxy_namespace=namespace,
            proxy_domain=normalise_proxy_domain(domain or f"{namespace}.svc.cluster.local", namespace),
            respond_before_sync=respond_before_sync,
        )
