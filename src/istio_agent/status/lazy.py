"""Status-server handlers built on first use, so that their imports stay off the agent's start-up path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from istio_agent.http.messages import Request, StreamResponse


class Service(Protocol):
    """What a lazily built handler is: a request handler with a ``close()``."""

    async def handle(self, request: Request) -> StreamResponse: ...

    async def close(self) -> None: ...


class LazyHandler:
    """Calls ``build()`` (which may import what it needs) on the first request, then its ``handle``."""

    def __init__(self, build: Callable[[], Service]) -> None:
        self._build = build
        self._service: Service | None = None

    async def __call__(self, request: Request) -> StreamResponse:
        if self._service is None:
            self._service = self._build()
        return await self._service.handle(request)

    async def close(self) -> None:
        if self._service is not None:
            await self._service.close()
