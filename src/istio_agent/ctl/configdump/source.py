"""Where a view's document comes from: Envoy's admin (the paths istioctl asks) or a saved file.

istioctl asks ``config_dump`` with a mask per view (``istioctl/pkg/proxyconfig/proxyconfig.go``) and
``clusters?format=json`` for ``endpoint``; ``-f FILE`` (``-`` for stdin) reads a saved answer.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from istio_agent.config.proxy_config import split_host_port

DEFAULT_ADMIN = "127.0.0.1:15000"
MAX_DOCUMENT = 256 * 1024 * 1024
PATHS = {
    "cluster": "/config_dump?mask=dynamic_active_clusters,dynamic_warming_clusters,static_clusters",
    "listener": "/config_dump?mask=dynamic_listeners,static_listeners",
    "route": "/config_dump?mask=dynamic_route_configs,static_route_configs",
    "bootstrap": "/config_dump?mask=bootstrap",
    "all": "/config_dump?include_eds=true",
    "eds": "/config_dump?include_eds=true",
    "ecds": "/config_dump?include_eds=true",
    "endpoint": "/clusters?format=json",
}


class ConfigDumpError(Exception):
    """The document could not be read or lacks what the view needs; the message says which (istioctl's words)."""


@dataclass(frozen=True)
class Source:
    """An admin address, or a file (``-`` is stdin) when ``file`` is set."""

    address: str = DEFAULT_ADMIN
    file: str | None = None
    timeout: float = 5.0


async def read_bytes(source: Source, view: str) -> bytes:
    """The raw answer for ``view``: the file's bytes, or what Envoy's admin answers on istioctl's path."""
    if source.file is not None:
        return read_file(source.file)
    return await fetch_ok(source.address, PATHS[view], source.timeout)


def read_file(path: str, limit: int = MAX_DOCUMENT) -> bytes:
    """A saved document (``-`` is stdin); ConfigDumpError when it cannot be read or passes ``limit``."""
    try:
        if path == "-":
            data = sys.stdin.buffer.read(limit + 1)
        else:
            with open(path, "rb") as file:
                data = file.read(limit + 1)
    except OSError as err:
        raise ConfigDumpError(f"open {path}: {(err.strerror or str(err)).lower()}") from None
    if len(data) > limit:
        raise ConfigDumpError(f"{path} is larger than {limit} bytes")
    return data


async def get(
    address: str, target: str, timeout: float, what: str = "Envoy's admin", *, method: str = "GET"
) -> tuple[int, bytes]:
    """(status, body) of a request (a GET unless ``method`` says otherwise) of ``target`` at an
    admin-style ``HOST:PORT``; ConfigDumpError naming ``what`` when it cannot be asked or does not
    answer in time."""
    from istio_agent.http.client import URL, HTTPError, fetch

    try:
        host, port = split_host_port(address)
    except ValueError as err:
        raise ConfigDumpError(f"{what} address {err}") from None
    url = URL("http", host, port, target)
    try:
        answer = await fetch(
            method, url, headers=[("Host", url.address)], timeout=timeout, max_body=MAX_DOCUMENT
        )
    except TimeoutError:
        raise ConfigDumpError(f"{what} at {address} did not answer within {timeout:g}s") from None
    except (HTTPError, OSError) as err:
        raise ConfigDumpError(f"{what} at {address}: {err}") from None
    return answer.status, answer.body


async def fetch_ok(address: str, target: str, timeout: float) -> bytes:
    """Envoy's admin answer to ``target``; ConfigDumpError unless it is a 200."""
    status, body = await get(address, target, timeout)
    if status != 200:
        text = body[:200].decode(errors="replace").strip()
        raise ConfigDumpError(f"Envoy's admin at {address} answered {status}: {text}")
    return body


def parse(data: bytes, key: str) -> dict[str, Any]:
    """The JSON object with a ``key`` list (``configs`` for a dump), as istioctl's Prime reads it."""
    try:
        document = read_json(data)
    except ValueError as err:
        raise ConfigDumpError(f"error unmarshalling config dump response from Envoy: {err}") from None
    if not isinstance(document, dict) or not isinstance(document.get(key, []), list):
        raise ConfigDumpError(f'error unmarshalling config dump response from Envoy: no "{key}" list')
    return document


def read_json(data: bytes | str) -> Any:
    """JSON as Go's ``encoding/json`` reads it; ValueError for what it refuses (``NaN``, numbers
    Python will not convert) or what is nested too deeply for Python."""
    try:
        return json.loads(data, parse_constant=_refuse_constant, parse_int=_int)
    except RecursionError:
        raise ValueError("the document is nested too deeply") from None
    except UnicodeDecodeError as err:
        raise ValueError(str(err)) from None


def _int(text: str) -> int:
    if len(text.lstrip("-")) > 400:  # no field holds it; Python would refuse past 4300 digits anyway
        raise ValueError(f"a {len(text)}-digit integer is out of range")
    return int(text)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"invalid character {name[0]!r} looking for beginning of value")


class Dump:
    """A config dump's sections by type URL (istioctl's ``configdump.Wrapper``)."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.configs = [c for c in document.get("configs") or [] if isinstance(c, dict)]

    @classmethod
    def from_bytes(cls, data: bytes) -> Dump:
        return cls(parse(data, "configs"))

    def sections(self, kind: str) -> list[dict[str, Any]]:
        url = f"type.googleapis.com/envoy.admin.v3.{kind}"
        found = [c for c in self.configs if c.get("@type") == url]
        if not found:
            raise ConfigDumpError(f"config dump has no configuration type {url}")
        return found

    def section(self, kind: str) -> dict[str, Any]:
        """The last section of ``kind`` (``ClustersConfigDump``…), as istioctl's getSection."""
        return self.sections(kind)[-1]
