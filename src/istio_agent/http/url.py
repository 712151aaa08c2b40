"""An absolute http(s) URL and the HTTP stack's base error: what reading a config with a URL needs,
without the stack itself (h11, ssl), so a short-lived process that may not make a request at all
(the CNI plugin, for a pod it skips) does not import it.

The CNI plugin parses its kubeconfig's server on every ADD, so this module is kept cheap to import
(docs/performance.md, "CNI plugin ADD"): :class:`URL` is a NamedTuple rather than a dataclass (~0.5 ms
of generated code), and it splits URLs itself rather than with ``urllib.parse`` (~1 ms to import):
an absolute http(s) URL is read as ``urllib.parse.urlsplit`` reads it (``tests/http/test_url.py``
compares the two), except that spaces and control characters are refused instead of stripped.
"""

from __future__ import annotations

from typing import NamedTuple

DEFAULT_PORTS = {"http": 80, "https": 443}
_AUTHORITY_ENDS = "/?#"
_MAX_PORT = 65535


class HTTPError(Exception):
    """An HTTP exchange failed; the message says how (never with the body or credentials)."""


class URL(NamedTuple):
    """An absolute http(s) URL, its target kept exactly as given (nothing is re-encoded)."""

    scheme: str
    host: str
    port: int
    target: str

    @classmethod
    def parse(cls, url: str) -> URL:
        """``scheme://[userinfo@]host[:port][/path][?query][#fragment]``; the fragment and the
        userinfo are dropped, the scheme and the host name lower-cased; HTTPError when it is not
        such an http(s) URL."""
        if any(char <= " " or char == "\x7f" for char in url):
            raise _invalid(url, "spaces and control characters are not allowed")
        scheme, separator, rest = url.partition("://")
        scheme = scheme.lower()
        if not separator or scheme not in DEFAULT_PORTS:
            raise _invalid(url, "expected http(s)://host[:port]/path")
        end = min((at for at in map(rest.find, _AUTHORITY_ENDS) if at >= 0), default=len(rest))
        host, port = _host_port(url, rest[:end].rpartition("@")[2])
        path, _, query = rest[end:].partition("#")[0].partition("?")
        target = (path or "/") + (f"?{query}" if query else "")
        return cls(scheme, host, port or DEFAULT_PORTS[scheme], target)

    @property
    def authority(self) -> str:
        """``host[:port]`` as the Host header carries it (no port when it is the scheme's default)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def join(self, location: str) -> URL:
        """A redirect's ``Location`` resolved against this URL (RFC 3986, as ``urljoin`` does it)."""
        from urllib.parse import urljoin  # redirects are followed by the agent's probes, not the plugin

        return URL.parse(urljoin(str(self), location))

    def __str__(self) -> str:
        return f"{self.scheme}://{self.authority}{self.target}"


def _host_port(url: str, hostport: str) -> tuple[str, int]:
    """The host (an IPv6 address without its brackets) and the port (0: none given) of
    ``host[:port]``; HTTPError naming ``url``."""
    if hostport.startswith("["):
        host, closed, after = hostport[1:].partition("]")
        if not closed or (after and not after.startswith(":")):
            raise _invalid(url, "a bracketed host is an IPv6 address, followed by nothing but :port")
        _check_ipv6(url, host)
        port = after[1:]
    elif "[" in hostport or "]" in hostport:
        raise _invalid(url, "brackets around anything but the whole host")
    else:
        host, _, port = hostport.partition(":")
    if not host:
        raise _invalid(url, "expected http(s)://host[:port]/path")
    name, percent, zone = host.partition("%")  # an IPv6 zone keeps its case
    if not port:
        return name.lower() + percent + zone, 0
    if not (port.isascii() and port.isdigit()) or int(port) > _MAX_PORT:
        raise _invalid(url, f"port {port!r} is not a number from 0 to {_MAX_PORT}")
    return name.lower() + percent + zone, int(port)


def _check_ipv6(url: str, host: str) -> None:
    import ipaddress  # only for a bracketed host

    try:
        ipaddress.IPv6Address(host)
    except ValueError as err:
        raise _invalid(url, str(err)) from None


def _invalid(url: str, why: str) -> HTTPError:
    return HTTPError(f"invalid URL {url!r}: {why}")
