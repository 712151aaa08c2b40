"""The plugin's side of the ADD hand-over: give the invocation to the warm node agent, print its answer.

A Python plugin exec'd per pod spends most of an ADD importing (asyncio, ssl, the HTTP client, the
rule builder) before it does any work. install-cni, the node agent that runs all along, listens on
``<cni_agent_run_dir>/plugin-add.sock`` (:mod:`istio_agent.cni.install.add_server`) and runs the
same ADD code (``cni/plugin.py``) with everything already imported. Istio's ambient mode has its
plugin talk to the node agent over a socket in the same directory (``pluginevent.sock``); this
socket is ours, with its own protocol:

* the plugin connects, sends ONE JSON object and shuts its side down: ``env`` (the environment the
  runtime gave it), ``stdin`` (the network config, as text), ``elapsed`` (seconds since the plugin
  started: the ADD deadline counts from there) and ``netns`` (``[st_dev, st_ino]`` of CNI_NETNS as
  the plugin sees it, or null);
* the node agent answers ONE JSON object and closes: ``{"exit": <status>, "stdout": <text>}`` (what
  the plugin prints and exits with: the CNI result or error result), or ``{"fallback": <reason>}``
  when it cannot run this ADD for the plugin (it does not see the same network namespace): the
  plugin then runs the ADD itself.

No socket, or nobody listening on it (install-cni stopped): the plugin runs the ADD itself, as
without a node agent. So it does when the socket's listener is neither root nor the plugin's own
user (``SO_PEERCRED``): the runtime runs the plugin as root and install-cni runs as root, so such
a socket is not install-cni's (a squatter on a world-writable run dir gets neither the invocation
nor a say in its result). The plugin's own user may control the plugin anyway (tests run both
sides unprivileged). A node agent that takes the connection but does not answer within the ADD
deadline, or answers nonsense, is a CNI error: failing closed as the in-process ADD does.

Imports only ``os``, ``json``, ``socket``, ``struct``, ``time`` and ``skel`` (which imports only
``os``): the point is to import nothing else. A config that sets ``add_timeout`` (install-cni
writes none) also loads the agent's Go duration parser (``config/env.py``), so both sides read it
alike.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time

from istio_agent.cni import skel

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

SOCKET_NAME = "plugin-add.sock"
DEFAULT_ADD_SECONDS = 30.0
"""The ADD deadline when the config gives none (``plugin.DEFAULT_ADD_TIMEOUT`` is this)."""
MAX_MESSAGE = 2**20
"""The largest message the node agent reads (an environment and a config are far smaller); a larger
one is not handed over: the plugin runs that ADD itself, as it would without a node agent."""
MAX_ANSWER = 8 * MAX_MESSAGE
"""Whatever a handed-over ADD prints fits: its result is the config's prevResult, typed (nothing
grows by nesting), so the answer is at most about 7 times the message (a ``<`` is printed as
``\\u003c``, whose backslash the answer escapes again; indentation adds less)."""
MAX_SOCKET_PATH = 108
"""Linux's ``sun_path`` size, terminating NUL included."""
_PEERCRED = struct.Struct("iII")
"""``struct ucred``: pid, uid, gid."""


class Fallback(Exception):
    """The plugin runs the ADD itself (no node agent, or it declined); the message says why, and the
    plugin logs it once its logging is set up (as a warning when ``warning``: the operator should
    look, e.g. the socket is served by another user)."""

    def __init__(self, reason: str, *, warning: bool = False) -> None:
        super().__init__(reason)
        self.warning = warning


def peer_uid(sock: socket.socket) -> int:
    """The effective uid of the process at the other end of a connected unix socket, as it was when
    that process connected (or, for a listener, called listen())."""
    _pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return int(uid)


def _budget_seconds(add_timeout: object) -> float | None:
    """The ADD deadline in seconds, ``add_timeout`` read as the in-process ADD reads it (a Go duration
    of at least 1ms, up to Go's longest); the default without one; None for anything else (the
    in-process ADD then reports it)."""
    if add_timeout is None:
        return DEFAULT_ADD_SECONDS
    if not isinstance(add_timeout, str):
        return None
    # Imported only here: a config without add_timeout (install-cni writes none) does not pay for it.
    from istio_agent.config.env import parse_go_duration

    try:
        seconds = parse_go_duration(add_timeout).total_seconds()
    except ValueError:
        return None
    return seconds if seconds >= 0.001 else None


def netns_id(path: str) -> list[int] | None:
    """``[st_dev, st_ino]`` of a namespace path as this process sees it, None when it sees nothing."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):  # ValueError: a NUL byte, which no path has
        return None
    return [info.st_dev, info.st_ino]


def hand_over(environ: Mapping[str, str], stdin: bytes, started: float) -> tuple[int, str]:
    """The node agent's exit status and stdout for this ADD; raises Fallback when the plugin must run
    it itself. A node agent that fails to answer in time yields a CNI error result (exit 1)."""
    try:
        config = json.loads(stdin)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the decoder follows
        raise Fallback("the config is not JSON (the ADD reports it)") from None
    if not isinstance(config, dict):
        raise Fallback("the config is not a JSON object (the ADD reports it)")
    run_dir = config.get("cni_agent_run_dir")
    budget = _budget_seconds(config.get("add_timeout"))
    if not isinstance(run_dir, str) or not run_dir or budget is None:
        raise Fallback("no cni_agent_run_dir, or an add_timeout that is not a Go duration of 1ms or more")
    path = os.path.join(run_dir, SOCKET_NAME)
    if len(os.fsencode(path)) >= MAX_SOCKET_PATH:
        raise Fallback(f"{path} is too long for a unix socket: no node agent can listen there")
    message = {
        "env": dict(environ),
        "stdin": stdin.decode("utf-8", errors="surrogateescape"),
        "elapsed": time.monotonic() - started,
        "netns": netns_id(environ.get("CNI_NETNS", "")),
    }
    data = json.dumps(message).encode("utf-8", errors="surrogateescape")
    if len(data) > MAX_MESSAGE:
        raise Fallback(f"the invocation is too large to hand over ({len(data)} bytes, at most {MAX_MESSAGE})")
    deadline = started + budget
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError as err:  # out of descriptors or memory: an error result, not a traceback
        return _error(f"cannot open a socket to the node agent: {err.strerror or err}")
    try:
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as err:
            raise Fallback(f"no node agent on {path}: {err.strerror}") from None
        except OSError as err:
            return _error(f"cannot reach the node agent on {path}: {err.strerror or err}")
        try:
            uid = peer_uid(sock)
            if uid not in (0, os.geteuid()):
                raise Fallback(
                    f"{path} is served by uid {uid}, neither root nor this plugin's user: not install-cni,"
                    " not trusted with the ADD",
                    warning=True,
                )
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            answer = _read_answer(sock, deadline)
        except TimeoutError:
            return _error(f"the node agent on {path} did not answer within the ADD deadline of {budget:g}s")
        except OSError as err:
            return _error(f"the node agent on {path} failed: {err.strerror or err}")
    finally:
        sock.close()
    return _parse_answer(answer, path)


def _read_answer(sock: socket.socket, deadline: float) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        sock.settimeout(remaining)
        chunk = sock.recv(65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_ANSWER:
            raise OSError(f"answer larger than {MAX_ANSWER} bytes")
        chunks.append(chunk)


def _parse_answer(data: bytes, path: str) -> tuple[int, str]:
    try:
        answer: Any = json.loads(data)
    except (ValueError, RecursionError):
        return _error(f"the node agent on {path} closed the connection without an answer")
    if not isinstance(answer, dict):
        return _error(f"the node agent on {path} answered something other than a JSON object")
    if isinstance(answer.get("fallback"), str):
        raise Fallback(f"the node agent declined: {answer['fallback']}")
    status, stdout = answer.get("exit"), answer.get("stdout")
    if not isinstance(status, int) or not isinstance(stdout, str):
        return _error(f"the node agent on {path} answered without exit and stdout")
    return status, stdout


def _error(msg: str) -> tuple[int, str]:
    """A CNI error result as ``skel`` prints it (the runtime sees what an in-process failure shows)."""
    return 1, skel.internal_error_text(msg)
