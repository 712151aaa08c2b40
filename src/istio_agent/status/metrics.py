"""Merged Prometheus metrics (docs/status.md): the agent's registry, Envoy's 15090 listener, app targets.

One scrape of ``/stats/prometheus`` returns, in order, the agent's own metrics (text 0.0.4), Envoy's
metrics and the application's. It always answers 200: a failing upstream is logged, counted in
``istio_agent_scrape_failures_total{type}`` and shown by ``istio_agent_scrape_target_up{target}``.

Memory stays bounded whatever an upstream sends (beyond Istio, which copies bodies whole):

- Envoy's body is relayed as it arrives; at most one incomplete line (up to ``HOLD_MAX``) is held.
- A single app target is relayed the same way and cut off at ``body_cap`` bytes.
- Several app targets are buffered (they are written in target order and the response format
  depends on all of them), each up to ``body_cap``: the peak is about ``len(targets) * body_cap``.

An upstream whose body is cut off (cap, deadline, broken connection) ends at the last complete
line, so what was already sent stays parseable; an OpenMetrics response still gets its ``# EOF``.

Every upstream gets the scrape timeout (``X-Prometheus-Scrape-Timeout-Seconds``, default 10 s —
Istio has none) from when it is first contacted, so a hanging app cannot hold the scrape forever.
"""

from __future__ import annotations

import asyncio
import enum
import math
import re
import zlib
from dataclasses import dataclass

from istio_agent.config.prometheus import PrometheusTargets, ScrapeTarget
from istio_agent.http.client import Client, ClientResponse, HTTPError
from istio_agent.http.headers import Headers
from istio_agent.http.messages import Request, StreamResponse
from istio_agent.log import scope
from istio_agent.metrics import Registry
from istio_agent.status.server import negotiate_encoding

log = scope("status")

DEFAULT_BODY_CAP = 10 * 2**20
DEFAULT_SCRAPE_TIMEOUT = 10.0
HOLD_MAX = 256 * 1024  # longest incomplete line held back; longer "lines" are passed through as is
GZIP_LEVEL = 1
WRITE_PIECE = 64 * 1024  # writes are sliced so a large held buffer is never copied whole
SCRAPE_TIMEOUT_HEADER = "X-Prometheus-Scrape-Timeout-Seconds"
ENVOY_TARGET = "envoy"
OPENMETRICS = "application/openmetrics-text"
TEXT_DEFAULT_ACCEPT = "text/plain;version=0.0.4"
OPENMETRICS_DEFAULT_ACCEPT = "application/openmetrics-text;version=0.0.1"
EOF_LINE = b"# EOF\n"


class _MergerMetrics:
    """The merged-metrics endpoint's own metrics."""

    def __init__(self, registry: Registry) -> None:
        self.scrapes = registry.gauge("scrapes_total", "Number of scrapes of the merged metrics endpoint.")
        self.failures = registry.gauge(
            "scrape_failures_total", "Number of failed scrapes of a merged metrics source.", ["type"]
        )
        self.target_up = registry.gauge(
            "scrape_target_up",
            "Whether the last scrape of a merged metrics target succeeded (1) or not (0).",
            ["target"],
        )


class MetricsFormat(enum.Enum):
    """An exposition format and the Content-Type the merged response announces for it."""

    TEXT = "text/plain; version=0.0.4; charset=utf-8"
    OPENMETRICS_0_0_1 = "application/openmetrics-text; version=0.0.1; charset=utf-8"
    OPENMETRICS_1_0_0 = "application/openmetrics-text; version=1.0.0; charset=utf-8"

    @property
    def content_type(self) -> str:
        return self.value

    @property
    def is_openmetrics(self) -> bool:
        return self is not MetricsFormat.TEXT


_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_MEDIA_TYPE = re.compile(rf"(?:{_TOKEN}/{_TOKEN}|\*)")
_PARAM = re.compile(rf"({_TOKEN})=({_TOKEN}|\"(?:[^\"\\]|\\.)*\")")


def _parse_media_range(text: str) -> tuple[str, list[tuple[str, str]]] | None:
    """``type/subtype`` (lower-cased) and its parameters, or None when unparsable."""
    media, *raw_params = (part.strip() for part in text.split(";"))
    if not _MEDIA_TYPE.fullmatch(media):
        return None
    params: list[tuple[str, str]] = []
    for raw in raw_params:
        if not raw:
            continue
        match = _PARAM.fullmatch(raw)
        if match is None:
            return None
        params.append((match.group(1).lower(), match.group(2)))
    return media.lower(), params


def negotiate_accept(header: str | None, *, openmetrics: bool) -> str:
    """The ``Accept`` header to send upstream, derived from the scraper's (Istio's filtering).

    Only text (and, when ``openmetrics``, OpenMetrics) survive; ``*``/``*/*`` mean text 0.0.4 and
    ``application/*`` means OpenMetrics 0.0.1; q-values are replaced by descending ``q=0.N`` in the
    original order. Unparsable entries are skipped; nothing left means text 0.0.4.
    """
    allowed = {"text/plain", "text/*"}
    if openmetrics:
        allowed.add(OPENMETRICS)
    kept: list[str] = []
    for entry in (header or "").split(","):
        parsed = _parse_media_range(entry.strip())
        if parsed is None:
            continue
        media, params = parsed
        if media in ("*", "*/*"):
            rendered = TEXT_DEFAULT_ACCEPT
        elif media == "application/*":
            if not openmetrics:
                continue
            rendered = OPENMETRICS_DEFAULT_ACCEPT
        elif media in allowed:
            rendered = ";".join([media, *(f"{key}={value}" for key, value in params if key != "q")])
        else:
            continue
        if rendered not in kept:
            kept.append(rendered)
    if not kept:
        return TEXT_DEFAULT_ACCEPT
    kept = kept[:9]  # q=0.N has one digit; the first entries are the preferred ones
    return ",".join(f"{media};q=0.{len(kept) - index}" for index, media in enumerate(kept))


def format_of(content_type: str | None) -> MetricsFormat:
    """The exposition format an upstream's Content-Type announces (anything unknown is text)."""
    parsed = _parse_media_range(content_type or "")
    if parsed is None or parsed[0] != OPENMETRICS:
        return MetricsFormat.TEXT
    version = next((value.strip('"') for key, value in parsed[1] if key == "version"), "")
    if version == "1.0.0":
        return MetricsFormat.OPENMETRICS_1_0_0
    if version in ("", "0.0.1"):
        return MetricsFormat.OPENMETRICS_0_0_1
    return MetricsFormat.TEXT


def strip_eof(body: bytearray) -> None:
    """Drop a trailing ``# EOF`` (with any trailing spaces/CR/LF) and end the body with a newline."""
    end = len(body)
    while end and body[end - 1] in b" \r\n":
        end -= 1
    start = end - len(b"# EOF")
    if start >= 0 and body[start:end] == b"# EOF" and (start == 0 or body[start - 1] in b"\r\n"):
        del body[start:]
    if body and body[-1:] != b"\n":
        body += b"\n"


def scrape_timeout(header: str | None) -> float:
    """Seconds each upstream may take: the scraper's own timeout, else ``DEFAULT_SCRAPE_TIMEOUT``."""
    if header is None:
        return DEFAULT_SCRAPE_TIMEOUT
    try:
        value = float(header)
    except ValueError:
        return DEFAULT_SCRAPE_TIMEOUT
    if not math.isfinite(value) or value <= 0:
        return DEFAULT_SCRAPE_TIMEOUT
    return value


class ScrapeError(Exception):
    """An upstream failed; the message says why (never contains the body)."""


class _Output:
    """The client response, remembering whether the output currently ends at a line boundary.

    With ``gzip`` the stream is compressed here at zlib level 1: level 6 (zlib's default) made a
    7 MB scrape cost ~5x the CPU of an uncompressed one for 25 % less output.
    """

    def __init__(self, response: StreamResponse, *, gzip: bool = False) -> None:
        self.response = response
        self.at_line_start = True
        self._compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS) if gzip else None

    async def write(self, data: bytes | bytearray, end: int | None = None) -> None:
        end = len(data) if end is None else end
        if end == 0:
            return
        with memoryview(data) as view:
            for start in range(0, end, WRITE_PIECE):
                piece: bytes | memoryview = view[start : min(start + WRITE_PIECE, end)]
                if self._compressor is not None:
                    piece = self._compressor.compress(piece)
                if piece:
                    await self.response.write(piece)  # copied by the server before it returns
            self.at_line_start = view[end - 1] == ord("\n")

    async def finish(self) -> None:
        """Flush the compressor (if any) and end the response."""
        if self._compressor is not None:
            await self.response.write(self._compressor.flush())
        await self.response.write_eof()

    async def end_line(self) -> None:
        if not self.at_line_start:
            await self.write(b"\n")


@dataclass
class _Buffered:
    """One target of a multi-target scrape, read whole (up to the cap)."""

    target: ScrapeTarget
    body: bytearray | None = None
    format: MetricsFormat = MetricsFormat.TEXT


class MetricsMerger:
    """The ``/stats/prometheus`` and ``/metrics`` handler of the status server."""

    def __init__(
        self,
        registry: Registry,
        *,
        envoy_port: int | None,
        app: PrometheusTargets | None,
        host: str = "127.0.0.1",
        body_cap: int = DEFAULT_BODY_CAP,
    ) -> None:
        self._registry = registry
        self._metrics = _MergerMetrics(registry)
        self._envoy_port = envoy_port
        self._app = app
        self._host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        self._body_cap = body_cap
        self._client = Client()  # one connection per upstream request, closed when the relay ends

    async def close(self) -> None:
        await self._client.aclose()

    def _headers(self, request: Request, *, openmetrics: bool) -> Headers:
        headers = Headers(
            [
                ("Accept", negotiate_accept(request.headers.get("Accept"), openmetrics=openmetrics)),
                ("Accept-Encoding", "identity"),  # the body is relayed as text; we compress ourselves
            ]
        )
        for name in ("User-Agent", SCRAPE_TIMEOUT_HEADER):
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        return headers

    def _app_url(self, target: ScrapeTarget) -> str:
        return f"http://{self._host}:{target.port}{target.path}"

    async def handle(self, request: Request) -> StreamResponse:
        self._metrics.scrapes.inc()
        timeout = scrape_timeout(request.headers.get(SCRAPE_TIMEOUT_HEADER))
        targets = self._app.targets if self._app is not None else ()
        app_headers = self._headers(request, openmetrics=True)
        single: ClientResponse | None = None
        single_deadline = 0.0
        buffered: list[_Buffered] = []
        fmt = MetricsFormat.TEXT
        try:
            # The app is contacted first: the response's Content-Type depends on what it answers.
            if len(targets) == 1:
                single_deadline = asyncio.get_running_loop().time() + timeout
                single = await self._open_single(targets[0], app_headers, single_deadline)
                if single is not None:
                    fmt = format_of(single.headers.get("Content-Type"))
            elif targets:
                buffered = list(
                    await asyncio.gather(*(self._fetch_buffered(t, app_headers, timeout) for t in targets))
                )
                fmt = self._merged_format(buffered)

            response = StreamResponse(200, content_type=fmt.content_type)
            gzip = negotiate_encoding(request.headers.get("Accept-Encoding", ""), zstd=False) == "gzip"
            response.headers.add("Vary", "Accept-Encoding")
            if gzip:
                response.headers["Content-Encoding"] = "gzip"
            await response.prepare(request)
            out = _Output(response, gzip=gzip)

            await self._write_agent(out)
            if self._envoy_port is not None:
                await self._relay_envoy(request, out, timeout)
            if single is not None:
                await self._relay_single(targets[0], single, out, fmt, single_deadline)
            elif buffered:
                await self._write_buffered(buffered, out, fmt)
            await out.finish()
            return response
        finally:
            if single is not None:
                await single.aclose()

    async def _write_agent(self, out: _Output) -> None:
        try:
            body = self._registry.expose()
        except Exception as exc:  # a broken collector must not cost the Envoy and app metrics
            self._metrics.failures.labels("agent").inc()
            log.warning("failed rendering agent metrics: %s", exc)
            return
        await out.write(body)

    async def _relay_envoy(self, request: Request, out: _Output, timeout: float) -> None:
        url = f"http://{self._host}:{self._envoy_port}/stats/prometheus"
        query = request.query_string  # appended as received, as Istio does
        if query:
            url += "?" + query
        deadline = asyncio.get_running_loop().time() + timeout
        headers = self._headers(request, openmetrics=False)
        upstream: ClientResponse | None = None
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    upstream = await self._client.request("GET", url, headers=headers)
                _check_status(upstream)
            except (TimeoutError, HTTPError, OSError, ScrapeError) as exc:
                self._failed("envoy", ENVOY_TARGET, _reason(exc))
                return
            error = await self._relay(upstream, out, cap=None, deadline=deadline)
        finally:
            if upstream is not None:
                await upstream.aclose()
        await out.end_line()
        if error is not None:
            self._failed("envoy", ENVOY_TARGET, error)
        else:
            self._metrics.target_up.labels(ENVOY_TARGET).set(1)

    async def _open_single(
        self, target: ScrapeTarget, headers: Headers, deadline: float
    ) -> ClientResponse | None:
        upstream: ClientResponse | None = None
        try:
            async with asyncio.timeout_at(deadline):
                upstream = await self._client.request("GET", self._app_url(target), headers=headers)
            _check_status(upstream)
            self._check_length(upstream)
        except (TimeoutError, HTTPError, OSError, ScrapeError) as exc:
            if upstream is not None:
                await upstream.aclose()
            self._failed("application", target.name, _reason(exc))
            return None
        return upstream

    async def _relay_single(
        self,
        target: ScrapeTarget,
        upstream: ClientResponse,
        out: _Output,
        fmt: MetricsFormat,
        deadline: float,
    ) -> None:
        error = await self._relay(upstream, out, cap=self._body_cap, deadline=deadline)
        if error is None:
            self._metrics.target_up.labels(target.name).set(1)
            return
        self._failed("application", target.name, error)
        await out.end_line()
        if fmt.is_openmetrics:
            await out.write(EOF_LINE)

    async def _relay(
        self,
        upstream: ClientResponse,
        out: _Output,
        *,
        cap: int | None,
        deadline: float,
    ) -> str | None:
        """Copy the body to the client line-wise; None on success, else why it was cut off.

        Complete lines are written as they arrive; an incomplete last line is held back (up to
        ``HOLD_MAX``) and dropped when the body is cut off, so the output ends cleanly.
        """
        held = bytearray()
        total = 0
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    chunk = await upstream.read_chunk()
            except TimeoutError:
                return "timed out"
            except (HTTPError, OSError) as exc:
                return f"reading the body failed: {_describe(exc)}"
            if not chunk:
                break
            total += len(chunk)
            over = cap is not None and total > cap
            if cap is not None and over:
                chunk = chunk[: len(chunk) - (total - cap)]
            data: bytes | bytearray
            if held:
                held += chunk
                data = held
            else:
                data = chunk  # nothing held back: relayed from the chunk itself, not copied first
            cut = data.rfind(b"\n") + 1
            if over:
                await out.write(data, cut)  # the complete lines within the cap
                return f"body exceeds the {cap} byte cap"
            if cut == 0 and len(data) < HOLD_MAX:
                if data is chunk:
                    held += chunk
                continue
            if cut == 0:  # no line structure: not text exposition, passed through for the scraper to judge
                cut = len(data)
            await out.write(data, cut)
            if data is held:
                del held[:cut]
            else:
                held += memoryview(chunk)[cut:]
        await out.write(held)
        return None

    def _check_length(self, upstream: ClientResponse) -> None:
        length = upstream.content_length
        if length is not None and length > self._body_cap:
            raise ScrapeError(f"body of {length} bytes exceeds the {self._body_cap} byte cap")

    async def _fetch_buffered(self, target: ScrapeTarget, headers: Headers, timeout: float) -> _Buffered:
        result = _Buffered(target)
        upstream: ClientResponse | None = None
        try:
            async with asyncio.timeout(timeout):
                upstream = await self._client.request("GET", self._app_url(target), headers=headers)
                _check_status(upstream)
                self._check_length(upstream)
                body = bytearray()
                while chunk := await upstream.read_chunk():
                    if len(body) + len(chunk) > self._body_cap:
                        raise ScrapeError(f"body exceeds the {self._body_cap} byte cap")
                    body += chunk
        except (TimeoutError, HTTPError, OSError, ScrapeError) as exc:
            self._failed("application", target.name, _reason(exc))
            return result
        finally:
            if upstream is not None:
                await upstream.aclose()
        self._metrics.target_up.labels(target.name).set(1)
        strip_eof(body)
        result.body = body
        result.format = format_of(upstream.headers.get("Content-Type"))
        return result

    @staticmethod
    def _merged_format(results: list[_Buffered]) -> MetricsFormat:
        """The first successful target's format, or text when the successful targets disagree."""
        formats = [result.format for result in results if result.body is not None]
        if not formats or any(other is not formats[0] for other in formats[1:]):
            return MetricsFormat.TEXT
        return formats[0]

    @staticmethod
    async def _write_buffered(results: list[_Buffered], out: _Output, fmt: MetricsFormat) -> None:
        for result in results:
            if result.body is not None:
                await out.write(result.body)
                result.body = None  # let it go as soon as it is on the wire
        if fmt.is_openmetrics:
            await out.end_line()
            await out.write(EOF_LINE)

    def _failed(self, kind: str, target: str, reason: str) -> None:
        self._metrics.failures.labels(kind).inc()
        self._metrics.target_up.labels(target).set(0)
        log.warning("failed scraping %s metrics (%s): %s", kind, target, reason)


def _check_status(upstream: ClientResponse) -> None:
    if upstream.status != 200:
        raise ScrapeError(f"HTTP status {upstream.status}")


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return _describe(exc)


__all__ = [
    "MetricsFormat",
    "MetricsMerger",
    "format_of",
    "negotiate_accept",
    "scrape_timeout",
    "strip_eof",
]
