"""Envoy's admin API (stats, drain, quit) through the agent's HTTP/1.1 client.

The admin calls the agent makes during start-up (readiness) and shutdown (drain) are tiny GETs
and POSTs to a loopback port, one connection each. The client is imported on the first call: the
agent imports this module before it starts Envoy, and nothing it needs before then is here.
"""

from __future__ import annotations

MAX_BODY = 16 * 1024 * 1024
"""Admin answers the agent asks for are small (filtered stats); anything bigger is an error."""


class AdminError(Exception):
    """The admin call failed (connection, timeout, or a malformed answer); the message says which."""


async def admin_request(host: str, port: int, method: str, target: str, *, timeout: float) -> tuple[int, str]:
    """``method target`` against Envoy's admin; returns (status, body). Raises AdminError."""
    from istio_agent.http.client import URL, HTTPError, fetch

    url = URL("http", host.strip("[]"), port, target)
    try:
        answer = await fetch(method, url, headers=[("Host", url.address)], timeout=timeout, max_body=MAX_BODY)
    except TimeoutError:
        raise AdminError(f"timeout after {timeout:g}s") from None
    except HTTPError as err:
        raise AdminError(str(err)) from None
    return answer.status, answer.text()
