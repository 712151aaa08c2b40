"""install-cni's side of the ADD hand-over: run the plugin's ADD for it, warm (``cni/handoff.py``).

The plugin exec'd by the runtime sends its invocation (environment, stdin config) on
``<cni_agent_run_dir>/plugin-add.sock``; this server runs it through the very code the executable
runs (``skel.main`` with the same contract checks, then ``plugin.cmd_add``), with the invocation's
environment and the deadline counted from the plugin's start, and answers the exit status and
stdout. Each ADD runs in a worker thread of its own bounded pool (the ADD code is synchronous around
its own event loop), so a slow ADD never holds up another, nor install-cni's own loop. A slow API
server holds each of its ADDs up to the whole ADD deadline: when every worker is busy, the server
answers ``fallback`` at once and the plugin runs the ADD itself, in its own process, rather than
queueing it behind stuck ones.

Whoever connects chooses the ADD's environment (``DRY_RUN_FILE_PATH`` has install-cni write a file
as root), so the socket is created owner-only (bound under umask 077: never connectable by others,
not even before a chmod) and each peer must be root (``SO_PEERCRED``), as the runtime that execs the
plugin is.

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
import socket
import stat
import threading
import time
import traceback
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from istio_agent.cni import skel
from istio_agent.cni.handoff import MAX_MESSAGE, SOCKET_NAME, netns_id, peer_uid
from istio_agent.log import scope

log = scope("cni-agent")

READ_TIMEOUT = 5.0
"""The plugin sends its message at once; a connection that does not is dropped after this."""
MAX_CONCURRENT_ADDS = 8
"""ADDs run at once; more wait for none of them (the plugin runs those itself). A node starts a few
pods at a time; eight stuck behind a slow API server must not hold up the ninth."""
PEER_UID = 0
"""The runtime execs the plugin as root; nobody else may choose an ADD's environment."""


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
    except RecursionError:
        raise InvocationError("the hand-over message is nested too deeply") from None
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
    return netns_id(path) == seen_by_plugin


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


def run_add_answer(env: Mapping[str, str], stdin: bytes, started: float) -> dict[str, Any]:
    """:func:`run_add` as the answer to send; what ``skel.main`` did not turn into a result (a failing
    import, a bug around it) becomes a 999 error result naming it, logged with its traceback."""
    try:
        status, stdout = run_add(env, stdin, started)
    # The server's boundary for one ADD, hence the broad except: without an answer the plugin only
    # sees a closed connection, and the runtime never learns the real cause.
    except Exception as err:
        log.error("ADD hand-over: the ADD failed unexpectedly: %s\n%s", err, traceback.format_exc())
        return {
            "exit": 1,
            "stdout": skel.internal_error_text(
                f"the node agent's ADD failed: {str(err) or type(err).__name__}"
            ),
        }
    return {"exit": status, "stdout": stdout}


def remove_stale_socket(path: Path) -> None:
    """Remove ``path`` if it is a socket nobody listens on (left by a killed install-cni); raises
    OSError naming it when it is anything else (another file, or a socket that is served)."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise OSError(f"{path} exists and is not a socket: not replacing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except ConnectionRefusedError:
        path.unlink(missing_ok=True)
        return
    except OSError as err:
        raise OSError(f"cannot tell whether {path} is served: {err.strerror or err}") from None
    finally:
        probe.close()
    raise OSError(f"another process serves the ADD hand-over on {path}")


class AddServer:
    """The unix socket server; :meth:`start` binds (replacing a stale socket), :meth:`stop` removes it.

    ``max_adds`` bounds the ADDs run at once (the worker threads).
    """

    def __init__(self, run_dir: Path, *, max_adds: int = MAX_CONCURRENT_ADDS) -> None:
        if max_adds < 1:
            raise ValueError(f"max_adds must be at least 1, got {max_adds}")
        self.path = socket_path(run_dir)
        self.max_adds = max_adds
        self._server: asyncio.AbstractServer | None = None
        self._bound: tuple[int, int] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._free_workers = threading.BoundedSemaphore(max_adds)

    async def start(self) -> None:
        """Listen (owner only: the plugin runs as root); raises OSError naming the socket."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            remove_stale_socket(self.path)
        except OSError as err:
            raise OSError(f"the ADD hand-over cannot listen: {err}") from None
        previous = os.umask(0o077)  # the socket is born owner-only: no window before the chmod
        try:
            self._server = await asyncio.start_unix_server(self._accept, path=str(self.path))
            os.chmod(self.path, 0o600)
            info = self.path.lstat()
        except OSError as err:
            raise OSError(
                err.errno, f"the ADD hand-over cannot listen on {self.path}: {err.strerror}"
            ) from None
        finally:
            os.umask(previous)
        self._bound = (info.st_dev, info.st_ino)
        self._executor = ThreadPoolExecutor(self.max_adds, thread_name_prefix="cni-add")
        log.info("serving the plugin's ADD on %s (%d at once)", self.path, self.max_adds)

    async def stop(self) -> None:
        """Stop accepting and remove the socket if it is still ours (plugins run the ADD themselves
        from now on); ADDs already running finish in their threads."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        self._unlink_if_ours()
        await server.wait_closed()
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    def _unlink_if_ours(self) -> None:
        """Another install-cni may have replaced the path since: its socket is not ours to remove."""
        try:
            info = self.path.lstat()
        except FileNotFoundError:
            return
        if (info.st_dev, info.st_ino) == self._bound:
            self.path.unlink(missing_ok=True)
        else:
            log.info("not removing %s: it is no longer the socket this process bound", self.path)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            uid = peer_uid(writer.get_extra_info("socket"))
            if uid != PEER_UID:
                log.warning(
                    "ADD hand-over: refused a connection from uid %d: only root may hand an ADD over", uid
                )
                return
            try:
                answer = await self._answer(reader)
            except (ConnectionError, TimeoutError):
                raise
            # The server's boundary for one request, hence the broad except: a request it did not
            # foresee is answered as an error, not left to asyncio's traceback and a closed socket.
            except Exception as err:
                log.error("ADD hand-over: cannot serve the request: %s", str(err) or type(err).__name__)
                answer = {
                    "exit": 1,
                    "stdout": skel.internal_error_text(f"the node agent cannot serve the request: {err}"),
                }
            writer.write(json.dumps(answer).encode())
            await writer.drain()
        except (ConnectionError, TimeoutError) as err:
            log.warning("ADD hand-over: the plugin went away: %s", err)
        except OSError as err:  # SO_PEERCRED on a socket that is gone already
            log.warning("ADD hand-over: cannot serve the connection: %s", err)
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
            return {"exit": 1, "stdout": skel.internal_error_text(str(err))}
        if env.get("CNI_COMMAND") != "ADD":
            return {"fallback": "only ADD is handed over"}
        if not same_netns(env.get("CNI_NETNS", ""), netns):
            log.warning("ADD hand-over declined: %s is not the same namespace here", env.get("CNI_NETNS"))
            return {"fallback": f"the node agent does not see {env.get('CNI_NETNS')} as the plugin does"}
        return await self._run(env, stdin, received - elapsed)

    async def _run(self, env: Mapping[str, str], stdin: bytes, started: float) -> dict[str, Any]:
        """The ADD on a free worker, or ``fallback`` at once when there is none (the worker is freed
        when the ADD's thread ends, not when the connection does)."""
        if self._executor is None or not self._free_workers.acquire(blocking=False):
            log.warning("ADD hand-over declined: all %d ADD workers are busy", self.max_adds)
            return {"fallback": f"all {self.max_adds} of the node agent's ADD workers are busy"}

        def work() -> dict[str, Any]:
            try:
                return run_add_answer(env, stdin, started)
            finally:
                self._free_workers.release()

        try:
            future = self._executor.submit(work)
        except RuntimeError:  # shut down meanwhile
            self._free_workers.release()
            return {"fallback": "the node agent is stopping"}
        return await asyncio.wrap_future(future)


async def _read_to_eof(reader: asyncio.StreamReader) -> bytes:
    chunks, size = [], 0
    while chunk := await reader.read(65536):
        size += len(chunk)
        if size > MAX_MESSAGE:
            raise InvocationError(f"the hand-over message is larger than {MAX_MESSAGE} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
