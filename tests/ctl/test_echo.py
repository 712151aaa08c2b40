"""The demo's echo application answers with what it received."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from istio_agent.ctl.echo import make_app


async def test_echo_reports_headers_path_and_name() -> None:
    async with TestClient(TestServer(make_app("b"))) as client:
        response = await client.post("/hello?x=1", data=b"abc", headers={"X-Forwarded-Client-Cert": "By=x"})
        assert response.status == 200
        answer = await response.json()
    assert answer["app"] == "b"
    assert answer["method"] == "POST"
    assert answer["path"] == "/hello?x=1"
    assert answer["body_bytes"] == 3
    assert answer["headers"]["X-Forwarded-Client-Cert"] == "By=x"


async def test_metrics_count_the_requests_answered() -> None:
    async with TestClient(TestServer(make_app("b"))) as client:
        await client.get("/one")
        await client.get("/two")
        response = await client.get("/metrics")
        text = await response.text()
    assert response.content_type == "text/plain"
    assert 'echo_requests_total{app="b"} 2' in text
