"""A grpcio servicer call as an :class:`~istio_agent.rpc.call.Call`, for the servers not moved yet.

The local control plane and the debug tap still serve on grpcio; with this adapter they run on the
same xDS stream core as the SDS server. It goes when they move to :class:`RpcServer`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, NoReturn

import grpc

from istio_agent.rpc import Status
from istio_agent.rpc.call import CallEnded

_CODES = {code.value[0]: code for code in grpc.StatusCode}
_WRITE_ERRORS = (grpc.RpcError, grpc.aio.UsageError, grpc.aio.InternalError, asyncio.InvalidStateError)


def to_grpcio(code: Status) -> grpc.StatusCode:
    """grpcio's code for a status."""
    return _CODES[code.value]


class GrpcioCall:
    """One grpcio stream-stream call; ``context`` stays at hand for the control plane's authentication."""

    def __init__(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
        self._requests = requests
        self.context = context

    def peer(self) -> str:
        return str(self.context.peer())

    def metadata(self) -> Sequence[tuple[str, str | bytes]]:
        return [(str(key), value) for key, value in (self.context.invocation_metadata() or ())]

    def peer_certificate(self) -> bytes | None:
        return None  # the control plane reads its peers' certificates itself until it moves

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[Any]:
        try:
            async for message in self._requests:
                yield message
        except _WRITE_ERRORS as err:
            raise CallEnded(str(err)) from err

    async def send(self, message: Any) -> None:
        try:
            await self.context.write(message)
        except _WRITE_ERRORS as err:
            raise CallEnded(str(err)) from err

    async def abort(self, code: Status, details: str) -> NoReturn:
        await self.context.abort(to_grpcio(code), details)
        raise AssertionError("context.abort returned")  # it always raises
