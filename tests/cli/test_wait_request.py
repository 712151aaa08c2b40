"""``pilot-agent wait`` and ``pilot-agent request`` against a real HTTP server on loopback."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from istio_agent.cli.pilot_agent import CommandError, admin_request, wait_until_ready

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Done:
    returncode: int
    stdout: bytes
    stderr: str


@dataclass
class FakeServer:
    """An aiohttp server whose answers the test scripts; it records every request it saw."""

    port: int = 0
    statuses: list[int] = field(default_factory=list)  # answered in order; the last one repeats
    body: bytes = b"ok"
    hang: bool = False
    seen: list[tuple[str, str, bytes]] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)  # ends hanging handlers at teardown

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append((request.method, request.path_qs, await request.read()))
        if self.hang:
            await self.release.wait()
        status = self.statuses[min(len(self.seen), len(self.statuses)) - 1] if self.statuses else 200
        return web.Response(status=status, body=self.body)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/healthz/ready"


async def _serve(server: FakeServer, port: int) -> web.AppRunner:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", server.handle)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    server.port = runner.addresses[0][1]
    return runner


@pytest.fixture
async def fake() -> AsyncIterator[FakeServer]:
    server = FakeServer()
    runner = await _serve(server, 0)
    try:
        yield server
    finally:
        server.release.set()
        await runner.cleanup()


async def pilot_agent(*args: str, **env: str) -> Done:
    """Run the CLI as a subprocess without blocking the loop that serves the fake server."""
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "istio_agent.cli.pilot_agent",
        *args,
        env={**base, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 20)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return Done(proc.returncode, out, err.decode())


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- wait -----------------------------------------------------------------------------------------------------


async def test_wait_polls_until_ready(fake: FakeServer) -> None:
    fake.statuses = [503, 503, 200]
    done = await pilot_agent("wait", "--url", fake.url, "--periodMillis", "100", "--timeoutSeconds", "10")
    assert done.returncode == 0, done.stderr
    assert b"Envoy is ready!" in done.stdout
    assert len(fake.seen) == 3
    assert all(seen[:2] == ("GET", "/healthz/ready") for seen in fake.seen)


async def test_wait_timeout_reports_last_error(fake: FakeServer) -> None:
    fake.statuses = [503]
    done = await pilot_agent("wait", f"--url={fake.url}", "--periodMillis=100", "--timeoutSeconds=1")
    assert done.returncode == 255
    assert (
        "Error: timeout waiting for Envoy proxy to become ready. Last error: HTTP status code 503"
        in done.stderr
    )
    assert b"Envoy is ready!" not in done.stdout
    assert len(fake.seen) >= 2


async def test_first_attempt_is_after_one_period(fake: FakeServer) -> None:
    """A period longer than the timeout means no request at all, and Go's "<nil>" as the last error."""
    done = await pilot_agent("wait", "--url", fake.url, "--periodMillis", "3000", "--timeoutSeconds", "1")
    assert done.returncode == 255
    assert done.stderr.strip().endswith("Last error: <nil>")
    assert fake.seen == []


async def test_wait_connection_refused_is_the_last_error() -> None:
    url = f"http://127.0.0.1:{_closed_port()}/healthz/ready"
    done = await pilot_agent("wait", "--url", url, "--periodMillis", "100", "--timeoutSeconds", "1")
    assert done.returncode == 255
    assert f'Last error: Get "{url}"' in done.stderr
    assert "Traceback" not in done.stderr


async def test_request_timeout_bounds_each_attempt(fake: FakeServer) -> None:
    fake.hang = True
    await asyncio.wait_for(
        _expect_timeout(fake.url), timeout=10
    )  # the hanging server never stalls the wait loop
    assert len(fake.seen) >= 2


async def _expect_timeout(url: str) -> None:
    with pytest.raises(CommandError, match=r"Last error: .*timed out after 0\.2s"):
        await wait_until_ready(url, timeout=1, period=0.1, request_timeout=0.2)


async def test_wait_until_ready_in_process(fake: FakeServer) -> None:
    fake.statuses = [500, 200]
    await wait_until_ready(fake.url, timeout=5, period=0.05, request_timeout=1)
    assert len(fake.seen) == 2


async def test_wait_timeout_seconds_env_sets_the_default(fake: FakeServer) -> None:
    fake.statuses = [503]
    loop = asyncio.get_running_loop()
    started = loop.time()
    done = await pilot_agent("wait", "--url", fake.url, "--periodMillis", "100", WAIT_TIMEOUT_SECONDS="1")
    assert done.returncode == 255
    assert "timeout waiting for Envoy proxy" in done.stderr
    assert b"timeout: 1 seconds" in done.stdout
    assert loop.time() - started < 15  # far below the 60 s default


async def test_timeout_flag_wins_over_env(fake: FakeServer) -> None:
    fake.statuses = [503]
    done = await pilot_agent(
        "wait",
        "--url",
        fake.url,
        "--periodMillis",
        "100",
        "--timeoutSeconds",
        "1",
        WAIT_TIMEOUT_SECONDS="not-a-number",  # ignored: the flag was given
    )
    assert done.returncode == 255
    assert "timeout waiting for Envoy proxy" in done.stderr
    assert b"timeout: 1 seconds" in done.stdout


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--timeoutSeconds=-1"], {}, "--timeoutSeconds: must be between 0 and 9223372036"),
        (["--timeoutSeconds=1.5"], {}, "--timeoutSeconds: not an integer"),
        (["--timeoutSeconds=99999999999999999999"], {}, "--timeoutSeconds: not an integer"),  # beyond int64
        (["--timeoutSeconds=9999999999"], {}, "--timeoutSeconds: must be between 0 and 9223372036"),
        (["--periodMillis=abc"], {}, "--periodMillis: not an integer"),
        (["--periodMillis=0"], {}, "--periodMillis: must be between 1 and"),
        (["--requestTimeoutMillis=-5"], {}, "--requestTimeoutMillis: must be between 1 and"),
        (["--requestTimeoutMillis=9999999999999"], {}, "--requestTimeoutMillis: must be between 1 and"),
        ([], {"WAIT_TIMEOUT_SECONDS": "soon"}, "WAIT_TIMEOUT_SECONDS: not an integer"),
        ([], {"WAIT_TIMEOUT_SECONDS": "-3"}, "WAIT_TIMEOUT_SECONDS: must be between 0 and"),
        (["--url=ftp://example/"], {}, "invalid --url"),
        (["--noSuchFlag"], {}, "No such option"),
    ],
)
async def test_wait_rejects_bad_flags(args: list[str], env: dict[str, str], message: str) -> None:
    done = await pilot_agent("wait", *args, **env)
    assert done.returncode == 255
    assert message in done.stderr
    assert "Traceback" not in done.stderr


# --- request --------------------------------------------------------------------------------------------------


async def test_request_returns_body_and_strips_leading_slash(fake: FakeServer) -> None:
    fake.body = b'{"configs": []}'
    assert await admin_request("GET", "/config_dump?include_eds", port=fake.port) == b'{"configs": []}'
    assert fake.seen == [("GET", "/config_dump?include_eds", b"")]


async def test_request_404_is_not_an_error(fake: FakeServer) -> None:
    fake.statuses, fake.body = [404], b"not found"
    assert await admin_request("GET", "nope", port=fake.port) == b"not found"


async def test_request_500_fails_with_status_and_body(fake: FakeServer) -> None:
    fake.statuses, fake.body = [500], b"boom"
    with pytest.raises(CommandError, match=r"^received unsuccessful status code 500: boom$"):
        await admin_request("GET", "stats", port=fake.port)


async def test_request_posts_the_body(fake: FakeServer) -> None:
    await admin_request("POST", "logging?level=debug", "payload", port=fake.port)
    assert fake.seen == [("POST", "/logging?level=debug", b"payload")]


async def test_request_connection_refused_is_a_clear_error() -> None:
    with pytest.raises(CommandError, match=r'^Post "http://localhost:[0-9]+/drain": '):
        await admin_request("POST", "drain", port=_closed_port())


async def test_request_cli_prints_exactly_the_body() -> None:
    """The allowed ports are fixed: serve on 15004 when free, else skip."""
    server = FakeServer(body=b'{"a": 1}')
    try:
        runner = await _serve(server, 15004)
    except OSError:
        pytest.skip("port 15004 is in use")
    try:
        done = await pilot_agent("request", "--debug-port=15004", "POST", "/quitquitquit", "x=1")
        assert done.returncode == 0, done.stderr
        assert done.stdout == b'{"a": 1}\n'
        assert server.seen == [("POST", "/quitquitquit", b"x=1")]
        server.statuses = [503]
        failed = await pilot_agent("request", "--debug-port", "15004", "GET", "ready")
        assert failed.returncode == 255
        assert failed.stdout == b""
        assert 'received unsuccessful status code 503: {"a": 1}' in failed.stderr
    finally:
        server.release.set()
        await runner.cleanup()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--debug-port=8080", "GET", "stats"],
            "debug port 8080 is not in allowed list [15000 15004 15020 15021]",
        ),
        (["--debug-port=x", "GET", "stats"], "--debug-port: not an integer"),
        (["GET"], "requires at least 2 arg(s), only received 1"),
        ([], "requires at least 2 arg(s), only received 0"),
    ],
)
async def test_request_argument_errors(args: list[str], message: str) -> None:
    done = await pilot_agent("request", *args)
    assert done.returncode == 255
    assert message in done.stderr
    assert done.stdout == b""


async def test_request_failure_keeps_stdout_empty(tmp_path: Path) -> None:
    """Nothing on a refused port 15020/15021 here, or something that is not us: either way no log on stdout."""
    done = await pilot_agent("request", "--debug-port=15021", "GET", "/no/such/path/for/this/test")
    if done.returncode == 0:
        pytest.skip("something answers on localhost:15021")
    assert done.returncode == 255
    assert done.stdout == b""
    assert done.stderr.startswith("Error: ")
