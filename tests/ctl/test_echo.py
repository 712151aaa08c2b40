"""The demo's echo application answers with what it received."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from istio_agent.ctl.echo import make_handler
from istio_agent.http.server import ServerRunner, TCPSite


@pytest.fixture
async def echo_url() -> AsyncIterator[str]:
    runner = ServerRunner(make_handler("b"))
    site = TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site.port}"
    await runner.cleanup()


async def test_echo_reports_headers_path_and_name(echo_url: str) -> None:
    async with (
        aiohttp.ClientSession() as client,
        client.post(
            f"{echo_url}/hello?x=1", data=b"abc", headers={"X-Forwarded-Client-Cert": "By=x"}
        ) as response,
    ):
        assert response.status == 200
        answer = await response.json()
    assert answer["app"] == "b"
    assert answer["method"] == "POST"
    assert answer["path"] == "/hello?x=1"
    assert answer["body_bytes"] == 3
    assert answer["headers"]["X-Forwarded-Client-Cert"] == "By=x"


async def test_metrics_count_the_requests_answered(echo_url: str) -> None:
    async with aiohttp.ClientSession() as client:
        for path in ("/one", "/two"):
            async with client.get(f"{echo_url}{path}") as response:
                await response.read()
        async with client.get(f"{echo_url}/metrics") as response:
            text = await response.text()
            assert response.content_type == "text/plain"
    assert 'echo_requests_total{app="b"} 2' in text
