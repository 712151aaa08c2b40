"""An absolute http(s) URL and the HTTP stack's base error: what reading a config with a URL needs,
without the stack itself (h11, ssl), so a short-lived process that may not make a request at all
(the CNI plugin, for a pod it skips) does not import it.

:class:`URL` is a NamedTuple rather than a dataclass: the plugin imports this module on every ADD,
and a dataclass costs ~0.4 ms of generated code at import (docs/performance.md, "CNI plugin ADD").
"""

from __future__ import annotations

from typing import NamedTuple
from urllib.parse import urljoin, urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443}


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
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as err:
            raise HTTPError(f"invalid URL {url!r}: {err}") from None
        scheme = parts.scheme.lower()
        if scheme not in DEFAULT_PORTS or not parts.hostname:
            raise HTTPError(f"invalid URL {url!r}: expected http(s)://host[:port]/path")
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        return cls(scheme, parts.hostname, port or DEFAULT_PORTS[scheme], target)

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
        """A redirect's ``Location`` resolved against this URL."""
        return URL.parse(urljoin(str(self), location))

    def __str__(self) -> str:
        return f"{self.scheme}://{self.authority}{self.target}"
