"""Socket-path helpers: preparation, permissions and telling live gRPC sockets from stale files."""

from __future__ import annotations

import asyncio
import socket
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from istio_agent import uds


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _dead_socket(path: Path) -> None:
    """A socket file whose listener is gone, as left behind by a crashed agent."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()


@pytest.fixture
async def grpc_socket(tmp_path: Path) -> AsyncIterator[Path]:
    """A live gRPC server (no services needed: the HTTP/2 handshake is what counts)."""
    path = tmp_path / "live.sock"
    server = grpc.aio.server()
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    yield path
    await server.stop(None)


@pytest.fixture
async def raw_socket(tmp_path: Path) -> AsyncIterator[Path]:
    """A listening Unix socket that accepts connections and never says a word."""
    path = tmp_path / "raw.sock"
    held: list[asyncio.StreamWriter] = []

    async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_unix_server(hold, str(path))
    yield path
    for writer in held:
        writer.close()
    server.close()
    await server.wait_closed()


def test_prepare_creates_parent_dirs_with_0750(tmp_path: Path) -> None:
    path = tmp_path / "var" / "run" / "sds" / "socket"
    uds.prepare_socket_path(path)
    assert not path.exists()
    for directory in (tmp_path / "var", tmp_path / "var" / "run", path.parent):
        assert directory.is_dir()
        assert _mode(directory) == 0o750


def test_prepare_leaves_existing_parent_mode_alone(tmp_path: Path) -> None:
    parent = tmp_path / "existing"
    parent.mkdir(mode=0o755)
    parent.chmod(0o755)
    uds.prepare_socket_path(parent / "socket")
    assert _mode(parent) == 0o755


def test_prepare_removes_existing_file_and_socket(tmp_path: Path) -> None:
    regular = tmp_path / "regular"
    regular.write_text("left over")
    uds.prepare_socket_path(regular)
    assert not regular.exists()

    dead = tmp_path / "dead.sock"
    _dead_socket(dead)
    uds.prepare_socket_path(dead)
    assert not dead.exists()


def test_prepare_missing_file_is_fine(tmp_path: Path) -> None:
    uds.prepare_socket_path(tmp_path / "nothing-here")


def test_prepare_unremovable_path_raises_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "busy"
    path.mkdir()
    (path / "child").write_text("x")
    with pytest.raises(OSError, match=r"failed to remove existing file at .*busy"):
        uds.prepare_socket_path(path)


def test_prepare_rejects_overlong_path(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="longer than"):
        uds.prepare_socket_path(tmp_path / ("x" * 120))


def test_prepare_warns_when_parent_cannot_be_created(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    uds.prepare_socket_path(blocker / "sub" / "socket")
    assert "failed to create directory" in caplog.text


def test_a_socket_that_cannot_listen_says_which_path_and_why(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(
        OSError, match=r"xDS proxy could not listen on .*/file/sub/XDS: .*Not a directory: '.*/file/sub'"
    ):
        uds.listen(blocker / "sub" / "XDS", "xDS proxy")


def test_a_listening_socket_is_open_to_every_local_user(short_tmp: Path) -> None:
    path = short_tmp / "run" / "XDS"
    sock = uds.listen(path, "xDS proxy")
    try:
        assert stat.S_IMODE(path.stat().st_mode) == uds.SOCKET_MODE
        assert stat.S_IMODE(path.parent.stat().st_mode) == uds.SOCKET_DIR_MODE
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))  # queued until a server serves the socket
    finally:
        sock.close()


def test_make_socket_accessible(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    _dead_socket(path)
    path.chmod(0o600)
    uds.make_socket_accessible(path)
    assert _mode(path) == 0o666


async def test_healthy_for_live_grpc_server(grpc_socket: Path) -> None:
    assert await uds.socket_is_healthy(grpc_socket)


async def test_healthy_for_the_agents_own_server(short_tmp: Path) -> None:
    from istio_agent.rpc.server import RpcServer

    path = short_tmp / "ours.sock"
    server = RpcServer()
    await server.start(sock=uds.listen(path, "test server"))
    try:
        assert await uds.socket_is_healthy(path)
    finally:
        await server.stop(None)


async def test_not_healthy_for_a_server_that_speaks_something_else(tmp_path: Path) -> None:
    path = tmp_path / "http1.sock"

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    server = await asyncio.start_unix_server(answer, str(path))
    try:
        started = asyncio.get_running_loop().time()
        assert not await uds.socket_is_healthy(path, timeout=3)
        assert asyncio.get_running_loop().time() - started < 1  # told apart at once, not by the timeout
    finally:
        server.close()


async def test_not_healthy_for_silent_socket(raw_socket: Path) -> None:
    assert not await uds.socket_is_healthy(raw_socket, timeout=0.3)


async def test_not_healthy_for_regular_file_or_missing_path(tmp_path: Path) -> None:
    regular = tmp_path / "file"
    regular.write_text("x")
    assert not await uds.socket_is_healthy(regular)
    assert not await uds.socket_is_healthy(tmp_path / "missing")


async def test_not_healthy_for_dead_socket(tmp_path: Path) -> None:
    path = tmp_path / "dead.sock"
    _dead_socket(path)
    assert not await uds.socket_is_healthy(path, timeout=0.5)


async def test_remove_if_stale(tmp_path: Path, grpc_socket: Path) -> None:
    dead = tmp_path / "dead.sock"
    _dead_socket(dead)
    assert await uds.remove_if_stale(dead)
    assert not dead.exists()

    regular = tmp_path / "file"
    regular.write_text("x")
    assert await uds.remove_if_stale(regular)
    assert not regular.exists()

    assert not await uds.remove_if_stale(tmp_path / "missing")

    assert not await uds.remove_if_stale(grpc_socket)
    assert grpc_socket.exists()
