"""The admin client: real HTTP/1.1 answers from a loopback server, in every framing Envoy uses."""

from __future__ import annotations

import pytest

from istio_agent.ctl.local import free_port
from istio_agent.envoy.admin import MAX_BODY, AdminError, admin_request
from tests.http.scripted import Scripted, scripted_fixture  # noqa: F401  (the "scripted" fixture)


async def test_content_length_answer_and_the_request_line(scripted: Scripted) -> None:
    port, requests = await scripted(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
    status, body = await admin_request("127.0.0.1", port, "GET", "/stats?filter=a%5E", timeout=2)
    assert (status, body) == (200, "hello")
    assert requests[0].startswith(b"GET /stats?filter=a%5E HTTP/1.1\r\nHost: 127.0.0.1:")


async def test_chunked_answer(scripted: Scripted) -> None:
    port, _ = await scripted(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n"
    )
    assert await admin_request("127.0.0.1", port, "POST", "/drain_listeners", timeout=2) == (200, "abcde")


async def test_body_until_close_and_error_status(scripted: Scripted) -> None:
    port, _ = await scripted(b"HTTP/1.1 503 Service Unavailable\r\n\r\n" + b"x" * 200_000)
    status, body = await admin_request("127.0.0.1", port, "GET", "/ready", timeout=2)
    assert status == 503 and len(body) == 200_000


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"garbage\r\n\r\n", "malformed response: illegal status line"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            "malformed response: illegal chunk header",
        ),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1),
            f"body of {MAX_BODY + 1} bytes exceeds the {MAX_BODY} byte cap",
        ),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "received 5 bytes, expected 10"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nabc\r\n",
            "malformed response: illegal chunk header",
        ),
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000 + b"\r\n\r\n", "response head larger than 65536 bytes"),
    ],
)
async def test_malformed_answers_are_admin_errors(scripted: Scripted, answer: bytes, message: str) -> None:
    port, _ = await scripted(answer)
    with pytest.raises(AdminError, match=message):
        await admin_request("127.0.0.1", port, "GET", "/stats", timeout=2)


async def test_timeout_and_refused(scripted: Scripted) -> None:
    port, _ = await scripted(None)
    with pytest.raises(AdminError, match=r"timeout after 0\.2s"):
        await admin_request("127.0.0.1", port, "GET", "/stats", timeout=0.2)
    with pytest.raises(AdminError, match="onnect"):
        await admin_request("127.0.0.1", free_port(), "GET", "/stats", timeout=2)
