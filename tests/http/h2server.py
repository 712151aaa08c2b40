"""A small HTTP/2 server for tests (the h2 package over asyncio), used by the h2 client and probe tests."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions

from tests.security.certs import issue, key_to_pem, make_ca, new_key, to_pem


@dataclass
class Seen:
    """A request as the server received it."""

    headers: list[tuple[str, str]]
    body: bytes
    peer: str

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)


@dataclass
class Reply:
    """What the server answers; the flags misbehave in the ways a client must survive."""

    status: int = 200
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    trailers: list[tuple[str, str]] = field(default_factory=list)
    trailers_only: bool = False  # HEADERS with END_STREAM (gRPC's trailers-only response)
    reset: bool = False  # RST_STREAM instead of an answer
    goaway: bool = False  # GOAWAY instead of an answer
    drop: bool = False  # close the socket instead of answering
    stall: bool = False  # never answer


Handler = Callable[[Seen], Awaitable[Reply]]


async def ok(seen: Seen) -> Reply:
    return Reply(body=b"hello")


class H2Server:
    """An HTTP/2 server (TLS with ALPN when given a context) that records requests and peers."""

    def __init__(self, handler: Handler = ok, tls: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.tls = tls
        self.seen: list[Seen] = []
        self.disconnected = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._stopped = asyncio.Event()

    async def start(self, host: str = "127.0.0.1") -> H2Server:
        self._server = await asyncio.start_server(self._accepted, host, 0, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        self._stopped.set()
        for writer in self._writers:
            writer.transport.abort()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, ssl.SSLError, h2.exceptions.H2Error):
            pass
        finally:
            self._tasks.discard(task)
            self._writers.discard(writer)
            writer.close()
            self.disconnected.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        )
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        peer = writer.get_extra_info("peername")[0]
        requests: dict[int, tuple[list[tuple[str, str]], bytearray]] = {}
        unsent: dict[int, tuple[bytes, list[tuple[str, str]]]] = {}
        while True:
            data = await reader.read(65536)
            if not data:
                return
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    requests[event.stream_id] = (list(event.headers or []), bytearray())  # type: ignore[arg-type]
                elif isinstance(event, h2.events.DataReceived):
                    assert event.stream_id is not None
                    requests[event.stream_id][1].extend(event.data or b"")
                    conn.acknowledge_received_data(event.flow_controlled_length or 0, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded) and event.stream_id in requests:
                    headers, body = requests.pop(event.stream_id)
                    seen = Seen(headers, bytes(body), peer)
                    self.seen.append(seen)
                    reply = await self.handler(seen)
                    if reply.stall:
                        await self._stopped.wait()
                        return
                    if reply.drop:
                        return
                    if reply.goaway:
                        conn.close_connection(error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
                    elif reply.reset:
                        conn.reset_stream(event.stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
                    else:
                        fields = [(":status", str(reply.status)), *reply.headers]
                        if reply.trailers_only:
                            conn.send_headers(event.stream_id, fields + reply.trailers, end_stream=True)
                        else:
                            conn.send_headers(event.stream_id, fields)
                            unsent[event.stream_id] = (reply.body, reply.trailers)
                self._send_bodies(conn, unsent)
            writer.write(conn.data_to_send())
            await writer.drain()

    @staticmethod
    def _send_bodies(
        conn: h2.connection.H2Connection, unsent: dict[int, tuple[bytes, list[tuple[str, str]]]]
    ) -> None:
        """Send as much of each pending body as flow control allows; then trailers or END_STREAM."""
        for stream_id, (body, trailers) in list(unsent.items()):
            while body:
                size = min(len(body), conn.local_flow_control_window(stream_id), conn.max_outbound_frame_size)
                if size <= 0:
                    break
                conn.send_data(stream_id, body[:size])
                body = body[size:]
            if body:
                unsent[stream_id] = (body, trailers)
                continue
            del unsent[stream_id]
            if trailers:
                conn.send_headers(stream_id, trailers, end_stream=True)
            else:
                conn.end_stream(stream_id)


def tls_server_context(tmp_path: Path, alpn: list[str] | None) -> ssl.SSLContext:
    """A TLS server context with a fresh certificate the probes do not verify."""
    ca_key, ca = make_ca()
    key = new_key()
    cert = issue(ca_key, ca, public_key=key.public_key(), dns_sans=["app.example"])
    (tmp_path / "h2-cert.pem").write_bytes(to_pem(cert))
    (tmp_path / "h2-key.pem").write_bytes(key_to_pem(key))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "h2-cert.pem", tmp_path / "h2-key.pem")
    if alpn:
        context.set_alpn_protocols(alpn)
    return context
