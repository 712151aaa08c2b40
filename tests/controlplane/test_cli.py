"""``agentctl token`` and ``agentctl controlplane`` as a user runs them."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner
from cryptography import x509

from istio_agent.cli.agentctl import main
from istio_agent.controlplane.tokens import Identity, TokenVerifier
from istio_agent.protos import istio_ca_pb2
from tests.grpc_stubs import istio_ca_pb2_grpc

from . import make_key, spiffe_csr, uri_sans
from .test_tokens import claims_of

AGENTCTL = [sys.executable, "-m", "istio_agent.cli.agentctl"]
START_TIMEOUT = 15.0
PROGRESS = {"control plane: CA root ": "root", "serving plaintext on ": "plaintext", "serving TLS on ": "TLS"}


def test_token_prints_only_a_verifiable_token(tmp_path: Path) -> None:
    state = tmp_path / "state"
    result = CliRunner().invoke(
        main,
        [
            "token",
            "--state-dir",
            str(state),
            "--namespace",
            "prod",
            "--service-account",
            "api",
            "--ttl",
            "1h",
        ],
    )
    assert result.exit_code == 0, result.output
    token = result.stdout
    assert token.endswith("\n") and token.count("\n") == 1
    assert re.fullmatch(r"[\w-]+\.[\w-]+\.[\w-]+\n", token)
    assert TokenVerifier(state).verify(token.strip()) == Identity("prod", "api")
    claims = claims_of(token.strip())
    assert claims["exp"] - claims["iat"] == 3600


def test_token_bad_input_is_a_one_line_error(tmp_path: Path) -> None:
    args = ["token", "--state-dir", str(tmp_path), "--namespace", "Not_Valid", "--service-account", "api"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "invalid namespace" in result.stderr


async def _agentctl(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *AGENTCTL, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[tuple[asyncio.subprocess.Process, Path, dict[str, str]]]:
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text(json.dumps({"trustDomain": "cli.example"}))
    state = tmp_path / "state"
    proc = await _agentctl(
        "controlplane",
        "--mesh",
        str(mesh),
        "--state-dir",
        str(state),
        "--address",
        "127.0.0.1:0",
        "--secure-address",
        "127.0.0.1:0",
        "--log_output_level",
        "default:info",
    )
    lines: dict[str, str] = {}
    try:
        assert proc.stdout is not None
        while len(lines) < 3:
            line = (await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT)).decode()
            assert line, "agentctl exited before it was serving"
            for prefix, name in PROGRESS.items():
                if line.startswith(prefix):
                    lines[name] = line[len(prefix) :].strip()
        yield proc, state, lines
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_controlplane_serves_and_stops_on_sigterm(
    running: tuple[asyncio.subprocess.Process, Path, dict[str, str]],
) -> None:
    proc, state, lines = running
    assert Path(lines["root"]) == state / "root-cert.pem"
    assert lines["plaintext"].startswith("127.0.0.1:") and lines["TLS"].startswith("127.0.0.1:")

    token = CliRunner().invoke(
        main, ["token", "--state-dir", str(state), "--namespace", "default", "--service-account", "sleep"]
    )
    identity = "spiffe://cli.example/ns/default/sa/sleep"
    creds = grpc.ssl_channel_credentials((state / "root-cert.pem").read_bytes())
    async with grpc.aio.secure_channel(lines["TLS"], creds) as channel:
        stub = istio_ca_pb2_grpc.IstioCertificateServiceStub(channel)
        response = await stub.CreateCertificate(
            istio_ca_pb2.IstioCertificateRequest(csr=spiffe_csr(make_key(), identity).decode()),
            metadata=[("authorization", f"Bearer {token.stdout.strip()}")],
            timeout=5,
        )
    assert uri_sans(x509.load_pem_x509_certificate(response.cert_chain[0].encode())) == [identity]

    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 5) == 0
    assert proc.stderr is not None
    logs = (await proc.stderr.read()).decode()
    assert f"signed certificate for {identity}" in logs
    assert token.stdout.strip() not in logs


async def _fails(*args: str) -> str:
    proc = await _agentctl(*args)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), START_TIMEOUT)
    assert proc.returncode == 1, stderr
    assert stdout == b""
    text = stderr.decode()
    assert text.count("\n") == 1, text
    return text


async def test_controlplane_missing_mesh_file(tmp_path: Path) -> None:
    err = await _fails("controlplane", "--mesh", str(tmp_path / "nope.yaml"), "--state-dir", str(tmp_path))
    assert "nope.yaml: file does not exist" in err


async def test_controlplane_unusable_state_dir(tmp_path: Path) -> None:
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text("{}")
    blocker = tmp_path / "file"
    blocker.write_text("")
    err = await _fails("controlplane", "--mesh", str(mesh), "--state-dir", str(blocker / "state"))
    assert "cannot use state directory" in err


async def test_controlplane_port_in_use(tmp_path: Path) -> None:
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text("{}")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = await _fails(
            "controlplane",
            "--mesh",
            str(mesh),
            "--state-dir",
            str(tmp_path / "state"),
            "--address",
            f"127.0.0.1:{port}",
            "--secure-address",
            "127.0.0.1:0",
        )
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in err
