"""Downloading a Wasm module over HTTP(S), as Istio's agent does (``pkg/wasm/httpfetcher.go``).

A GET with retries (network errors and 5xx but 501, 505 and 511, with exponential backoff from
0.5 s) for at most ``WASM_HTTP_REQUEST_MAX_RETRIES`` attempts of ``WASM_HTTP_REQUEST_TIMEOUT`` each,
all within the caller's timeout. Requests go through :class:`istio_agent.wasm.guarded.GuardedClient`:
redirects followed (10 at most), every connection, redirect hops included, dialled through the SSRF
guard, TLS unverified only for hosts in ``WASM_INSECURE_REGISTRIES``. The body may be a gzip and/or a tar of the module:
it is unwrapped, best effort, as Istio does.

Where we differ from Istio, on purpose: a module over ``ISTIO_WASM_MAX_BINARY_SIZE_BYTES`` is refused
with an error saying so (Istio's ``io.LimitReader`` silently truncates it), also when it is only that
large once decompressed; unwrapping stops after a few layers (a gzip that inflates to itself would
loop forever in Istio's ``unboxIfPossible``) and takes the first *regular* file of a tar (Istio takes
the first entry, a directory for some tools); an https URL redirecting to plain http is refused;
refusals that cannot change on retry (a blocked address, too many redirects, an oversize module) end
the fetch at once; at least one attempt is made even with ``WASM_HTTP_REQUEST_MAX_RETRIES=0``.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import tarfile
import zlib
from datetime import timedelta

from istio_agent.backoff import ExponentialBackoff
from istio_agent.config.wasm import WasmSettings
from istio_agent.http.client import URL, BodyTooLarge, ClientResponse, HTTPError
from istio_agent.http.exchange import describe
from istio_agent.log import scope
from istio_agent.wasm.errors import FetchError
from istio_agent.wasm.guarded import GuardedClient
from istio_agent.wasm.ssrf import DialGuard

log = scope("wasm")

WASM_MAGIC = b"\0asm"
MIN_WASM_SIZE = 8
"""The magic and the version: the least a module can be."""
FINAL_5XX = frozenset({501, 505, 511})
"""Not Implemented, HTTP Version Not Supported, Network Authentication Required: retrying won't help."""
DEFAULT_ATTEMPT_TIMEOUT = 5.0
"""Istio's per-request timeout when ``WASM_HTTP_REQUEST_TIMEOUT`` is 0."""
MAX_UNWRAP_LAYERS = 4
"""gzip, tar, and a little more: deeper nesting is not a module packaging anyone uses."""
_GZIP_MAGIC = b"\x1f\x8b"
_TAR_MAGIC = b"ustar"
_TAR_MAGIC_AT = 257
_READ_CHUNK = 1 << 20


def is_wasm_binary(data: bytes | bytearray) -> bool:
    """Starts with the Wasm magic and is long enough to hold the version (Istio's check)."""
    return len(data) >= MIN_WASM_SIZE and data.startswith(WASM_MAGIC)


class HttpFetcher:
    """GETs modules from http(s) URLs through the guard; one per agent, shared by every fetch."""

    def __init__(self, settings: WasmSettings, guard: DialGuard, *, initial_backoff: float = 0.5) -> None:
        self._settings = settings
        self._guard = guard
        self._initial_backoff = initial_backoff
        attempt = settings.http_timeout
        self._attempt_timeout = attempt.total_seconds() if attempt > timedelta(0) else DEFAULT_ATTEMPT_TIMEOUT

    async def fetch(self, url: str, *, timeout: float) -> bytes | bytearray:
        """The module at ``url`` (unwrapped from gzip/tar); ``FetchError`` (``download_failure``) if not.

        ``timeout`` bounds the whole fetch, retries and backoff included.
        """
        try:
            target = URL.parse(url)
        except HTTPError as err:
            raise FetchError(f"wasm module download failed: {err}") from None
        attempts = 0
        last = "timed out before the first request"
        backoff = ExponentialBackoff(initial=self._initial_backoff)
        max_attempts = max(1, self._settings.http_max_retries)
        try:
            async with asyncio.timeout(timeout):
                while attempts < max_attempts:
                    attempts += 1
                    try:
                        async with asyncio.timeout(self._attempt_timeout):
                            status, body = await self._get(target)
                    except TimeoutError:
                        last = f"GET {url}: no answer within {self._attempt_timeout:g}s"
                    except (HTTPError, OSError) as err:
                        last = f"GET {url}: {describe(err)}"
                    else:
                        if status == 200:
                            return unwrap(body, self._settings.max_binary_bytes, url)
                        last = f"wasm module download request failed: status code {status}"
                        if not _retryable(status):
                            break
                    log.debug("wasm module download attempt %d failed: %s", attempts, last)
                    if attempts < max_attempts:
                        await asyncio.sleep(backoff.next_delay())
        except TimeoutError:
            pass
        raise FetchError(f"wasm module download failed after {attempts} attempts, last error: {last}")

    async def _get(self, url: URL) -> tuple[int, bytes | bytearray]:
        """One GET and its redirects: the final status and, for a 200, the body."""
        client = GuardedClient(self._guard, skip_verify=self._skip_verify)
        try:
            async with client.send("GET", url) as response:
                body = await self._read(response, url) if response.status == 200 else b""
                return response.status, body
        finally:
            await client.aclose()

    async def _read(self, response: ClientResponse, url: URL) -> bytes | bytearray:
        limit = self._settings.max_binary_bytes
        try:
            return await response.read_buffer(limit)  # a module can be big: held once, not copied
        except BodyTooLarge:
            raise FetchError(_too_large(str(url), limit)) from None

    def _skip_verify(self, url: URL) -> bool:
        """A host in ``WASM_INSECURE_REGISTRIES`` (as ``host``, ``host:port`` or ``*``) skips TLS checks."""
        return self._settings.insecure(url.authority) or self._settings.insecure(url.address)


def unwrap(data: bytes | bytearray, limit: int, url: str = "the module") -> bytes | bytearray:
    """The Wasm module inside gzip and/or tar wrapping, or ``data`` unchanged when there is none.

    Best effort, as Istio: what is not a module, a gzip or a POSIX tar (or a broken one) is returned
    as it came, for the caller's checks to reject. A gzip that inflates past ``limit`` bytes is a
    ``FetchError``: it is never inflated beyond that.
    """
    current = data
    for _ in range(MAX_UNWRAP_LAYERS + 1):
        if is_wasm_binary(current):
            return current
        if current.startswith(_GZIP_MAGIC) and len(current) > len(_GZIP_MAGIC):
            inner = _gunzip(current, limit, url)
        elif len(current) > _TAR_MAGIC_AT + len(_TAR_MAGIC) and current[_TAR_MAGIC_AT:].startswith(
            _TAR_MAGIC
        ):
            inner = _first_regular_file(current)
        else:
            return data
        if inner is None:
            return data
        current = inner
    return data


def _gunzip(data: bytes | bytearray, limit: int, url: str) -> bytes | None:
    """The inflated content (every member), ``None`` if it is not valid gzip; FetchError past ``limit``."""
    out = bytearray()
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as reader:
            while chunk := reader.read(_READ_CHUNK):
                out += chunk
                if len(out) > limit:
                    raise FetchError(f"{url} decompresses to something {_too_large_tail(limit)}")
    except (OSError, EOFError, zlib.error):
        return None
    return bytes(out)


def _first_regular_file(data: bytes | bytearray) -> bytes | None:
    """The content of the tar's first regular file, ``None`` if there is none or the tar is broken."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for member in tar:
                if member.isreg():
                    content = tar.extractfile(member)
                    return content.read() if content is not None else None
    except (tarfile.TarError, OSError, EOFError):
        return None
    return None


def _retryable(status: int) -> bool:
    return status >= 500 and status not in FINAL_5XX


def _too_large(url: str, limit: int) -> str:
    return f"wasm module at {url} is {_too_large_tail(limit)}"


def _too_large_tail(limit: int) -> str:
    return (
        f"larger than the limit of {limit} bytes (ISTIO_WASM_MAX_BINARY_SIZE_BYTES); refused, not truncated"
    )
