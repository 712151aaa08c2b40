"""install-cni's side of the ADD hand-over: run the plugin's ADD for it, warm (``cni/handoff.py``).

The plugin exec'd by the runtime sends its invocation (environment, stdin config) on
``<cni_agent_run_dir>/plugin-add.sock``; this server runs it through the very code the executable
runs (``skel.main`` with the same contract checks, then ``plugin.cmd_add``), with the invocation's
environment and the deadline counted from the plugin's start, and answers the exit status and
stdout. Each ADD runs in a worker thread (the ADD code is synchronous around its own event loop),
so a slow ADD never holds up another, nor install-cni's own loop.

The pod's network namespace is the path the runtime gave (a host path: ``/var/run/netns/...`` or
``/proc/<pid>/ns/net``), so this process must see the host's: install-cni runs with the host's pid
namespace and the netns directory mounted at the same path (docs/cni.md). When its view of the path
is not the namespace the plugin saw (other ``st_dev``/``st_ino``, or only one side sees it), it
declines and the plugin runs the ADD itself: rules never go into a namespace the plugin did not mean.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from istio_agent.cni import skel
from istio_agent.cni.handoff import SOCKET_NAME
from istio_agent.log import scope

log = scope("cni-agent")

MAX_MESSAGE = 1 * 2**20
"""An invocation is an environment and a network config: far below this."""
READ_TIMEOUT = 5.0
"""The plugin sends its message at once; a connection that does not is dropped after this."""


class InvocationError(Exception):
    """The message is not an invocation; the plugin gets it as a CNI error (it fails closed)."""


def socket_path(run_dir: Path) -> Path:
    return run_dir / SOCKET_NAME


def parse_invocation(data: bytes) -> tuple[dict[str, str], bytes, float, list[int] | None]:
    """``env``, ``stdin``, ``elapsed`` and ``netns`` of a hand-over message; raises InvocationError."""
    try:
        message = json.loads(data)
    except ValueError as err:
        raise InvocationError(f"the hand-over message is not JSON: {err}") from None
    if not isinstance(message, dict):
        raise InvocationError("the hand-over message is not a JSON object")
    env, stdin, elapsed, netns = (message.get(key) for key in ("env", "stdin", "elapsed", "netns"))
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise InvocationError("the hand-over message's env is not an object of strings")
    if not isinstance(stdin, str):
        raise InvocationError("the hand-over message's stdin is not a string")
    if not isinstance(elapsed, int | float) or not 0 <= elapsed < 3600:
        raise InvocationError("the hand-over message's elapsed is not a number of seconds")
    if netns is not None and not (
        isinstance(netns, list) and len(netns) == 2 and all(isinstance(n, int) for n in netns)
    ):
        raise InvocationError("the hand-over message's netns is not [st_dev, st_ino] or null")
    return env, stdin.encode("utf-8", errors="surrogateescape"), float(elapsed), netns


def same_netns(path: str, seen_by_plugin: list[int] | None) -> bool:
    """Whether ``path`` here is the namespace the plugin saw (both not seeing it counts as the same:
    the ADD then reports a vanished namespace, as it would have in the plugin)."""
    try:
        info = os.stat(path)
    except OSError:
        return seen_by_plugin is None
    return seen_by_plugin == [info.st_dev, info.st_ino]


def run_add(env: Mapping[str, str], stdin: bytes, started: float) -> tuple[int, str]:
    """The ADD as the executable runs it, on this process's warm imports; (exit status, stdout)."""
    from istio_agent.cni.plugin import cmd_add

    def add(args: skel.CmdArgs) -> dict[str, Any]:
        return cmd_add(args, started=started, environ=env, configure_logging=False)

    out = io.StringIO()
    status = skel.main(
        {"ADD": add}, about="istio-cni (node agent)", environ=env, stdin=io.BytesIO(stdin), stdout=out
    )
    return status, out.getvalue()


class AddServer:
    """The unix socket server; :meth:`start` binds (replacing a stale socket), :meth:`stop` removes it."""

    def __init__(self, run_dir: Path) -> None:
        self.path = socket_path(run_dir)
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        """Listen (owner only: the plugin runs as root); raises OSError naming the socket."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)
        try:
            self._server = await asyncio.start_unix_server(self._accept, path=str(self.path))
            os.chmod(self.path, 0o600)
        except OSError as err:
            raise OSError(
                err.errno, f"the ADD hand-over cannot listen on {self.path}: {err.strerror}"
            ) from None
        log.info("serving the plugin's ADD on %s", self.path)

    async def stop(self) -> None:
        """Stop accepting and remove the socket (plugins run the ADD themselves from now on)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        self.path.unlink(missing_ok=True)
        await server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            answer = await self._answer(reader)
            writer.write(json.dumps(answer).encode())
            await writer.drain()
        except (ConnectionError, TimeoutError) as err:
            log.warning("ADD hand-over: the plugin went away: %s", err)
        finally:
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader) -> dict[str, Any]:
        received = time.monotonic()
        try:
            async with asyncio.timeout(READ_TIMEOUT):
                data = await _read_to_eof(reader)
            env, stdin, elapsed, netns = parse_invocation(data)
        except InvocationError as err:
            log.error("ADD hand-over: %s", err)
            return {"exit": 1, "stdout": skel.go_json(skel.CniError(skel.ERR_INTERNAL, str(err)).result())}
        if env.get("CNI_COMMAND") != "ADD":
            return {"fallback": "only ADD is handed over"}
        if not same_netns(env.get("CNI_NETNS", ""), netns):
            log.warning("ADD hand-over declined: %s is not the same namespace here", env.get("CNI_NETNS"))
            return {"fallback": f"the node agent does not see {env.get('CNI_NETNS')} as the plugin does"}
        status, stdout = await asyncio.to_thread(run_add, env, stdin, received - elapsed)
        return {"exit": status, "stdout": stdout}


async def _read_to_eof(reader: asyncio.StreamReader) -> bytes:
    chunks, size = [], 0
    while chunk := await reader.read(65536):
        size += len(chunk)
        if size > MAX_MESSAGE:
            raise InvocationError(f"the hand-over message is larger than {MAX_MESSAGE} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
