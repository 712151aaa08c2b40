"""Unix-domain-socket helpers for the agent's gRPC servers (SDS, xDS): path, permissions, liveness, limits.

Envoy runs as a different user than the agent in some deployments, so the socket is made
world-writable while its directory stays 0750. A socket file left behind by a dead agent must
not block a restart, but a live socket owned by someone else (an external SDS server such as
SPIRE) must be detected and left alone: both cases are told apart by speaking gRPC to it.

Being world-writable, the sockets take connections from any local process: ``ServerLimits`` says
how long a connection that does nothing is kept (see its fields).
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.exceptions

from istio_agent.log import scope

log = scope("sds")

SOCKET_DIR_MODE = 0o750
SOCKET_MODE = 0o666
MAX_SOCKET_PATH_BYTES = 107
"""sun_path holds 108 bytes including the terminating NUL on Linux."""


@dataclass(frozen=True)
class ServerLimits:
    """How long the agent's gRPC servers on Unix sockets keep a connection that does nothing.

    Envoy sends its HTTP/2 preface and settings as soon as it connects and keeps its xDS and SDS
    streams open for its whole life, so none of these bounds ever touches it.
    """

    handshake_timeout: float = 10.0
    """Seconds for a new client to send the HTTP/2 preface and settings (grpc alone waits a minute)."""
    idle_timeout: float = 300.0
    """Seconds a connection may hold no call before it is closed with GOAWAY; a client reconnects
    when it needs one again. Open streams, however quiet, are never idle."""
    keepalive_time: float = 30.0
    """Seconds between the server's HTTP/2 pings on a connection (also one that holds streams);
    a client's own pings are accepted down to half of it."""
    keepalive_timeout: float = 10.0
    """Seconds for a ping's answer; a client that stopped answering (frozen, gone) is closed."""


def _remove(path: Path) -> None:
    """Remove a file, socket, symlink or empty directory (what Go's os.Remove accepts)."""
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    else:
        path.unlink()


def prepare_socket_path(path: Path) -> OSError | None:
    """Make ``path`` ready to be bound: old file gone, parent directories present.

    Raises OSError when an existing file cannot be removed or the path is too long for a socket.
    A parent directory that cannot be created only warns (as Istio): binding will then fail, and the
    error returned here (None when the directory is there) is the reason to give.
    """
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise OSError(f"unix socket path {path} is longer than {MAX_SOCKET_PATH_BYTES} bytes")
    try:
        _remove(path)
    except (FileNotFoundError, NotADirectoryError):
        pass  # nothing there (a parent that is not a directory cannot hold a file either)
    except OSError as err:
        raise OSError(err.errno, f"failed to remove existing file at {path}: {err.strerror}") from err
    try:
        _make_dirs(path.parent)
    except OSError as err:
        log.warning("failed to create directory %s for unix socket: %s", path.parent, err)
        return err
    return None


def _make_dirs(directory: Path) -> None:
    """``mkdir -p`` where every directory created gets exactly SOCKET_DIR_MODE (umask aside)."""
    missing: list[Path] = []
    current = directory
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for created in reversed(missing):
        try:
            created.mkdir(mode=SOCKET_DIR_MODE)
        except FileExistsError:
            continue
        os.chmod(created, SOCKET_DIR_MODE)


def make_socket_accessible(path: Path) -> None:
    """Let any local user (Envoy may run under another uid) connect: chmod 0666 once listening."""
    os.chmod(path, SOCKET_MODE)


def listen(path: Path, what: str, backlog: int = 128) -> socket.socket:
    """A Unix socket listening on ``path`` (a stale file replaced), open to every local user.

    Connections wait in the kernel's queue until a server serves the socket. Raises OSError
    naming ``what``, the path and why when it cannot listen (a read-only directory in a pod that
    lacks the volume).
    """
    try:
        directory_error = prepare_socket_path(path)
    except OSError as err:
        raise OSError(err.errno, f"{what} could not listen on {path}: {err.strerror or err}") from err
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(os.fspath(path))
        listener.listen(backlog)
        make_socket_accessible(path)
    except OSError as err:
        listener.close()
        reason = directory_error or err
        raise OSError(err.errno, f"{what} could not listen on {path}: {reason}") from err
    listener.setblocking(False)
    return listener


async def socket_is_healthy(path: Path, timeout: float = 1.0) -> bool:
    """True when ``path`` is a non-regular file on which a gRPC server answers within ``timeout``.

    Answering is what a gRPC client waits for before it calls: the server's HTTP/2 SETTINGS after
    the client's preface. A connection refused (nobody listening) is reported at once instead of
    waiting for the timeout.
    """
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    if stat.S_ISREG(mode):
        return False
    try:
        async with asyncio.timeout(timeout):
            return await _answers_http2(path)
    except (TimeoutError, OSError, asyncio.IncompleteReadError):
        return False


_FRAME_HEADER_BYTES = 9
_SETTINGS_FRAME = 0x4


async def _answers_http2(path: Path) -> bool:
    reader, writer = await asyncio.open_unix_connection(os.fspath(path))
    try:
        connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        connection.initiate_connection()
        writer.write(connection.data_to_send())
        first = await reader.readexactly(_FRAME_HEADER_BYTES)
        if first[3] != _SETTINGS_FRAME:
            return False  # a server's preface is a SETTINGS frame: something else listens there
        data = first
        while data:
            try:
                events = connection.receive_data(data)
            except h2.exceptions.ProtocolError:
                return False  # something else listens there
            if any(isinstance(event, h2.events.RemoteSettingsChanged) for event in events):
                return True
            data = await reader.read(65536)
        return False
    finally:
        writer.close()


async def remove_if_stale(path: Path, timeout: float = 1.0) -> bool:
    """Delete ``path`` when it exists but no gRPC server answers on it; True when deleted.

    Raises OSError when a stale file cannot be deleted (the agent cannot bind there either).
    """
    try:
        path.lstat()
    except FileNotFoundError:
        return False
    if await socket_is_healthy(path, timeout):
        return False
    try:
        _remove(path)
    except FileNotFoundError:
        return False
    except OSError as err:
        raise OSError(err.errno, f"failed to remove stale socket {path}: {err.strerror}") from err
    log.info("removed stale unix socket %s", path)
    return True
