"""Every line ``pilot-agent`` prints is in Istio's format, its gRPC's included.

grpcio's C-core wrote its own lines straight to stderr (``I0102 03:04:05.000000 123
ssl_transport_security.cc:2563] Handshake failed ...``) when a TLS handshake failed; the agent's gRPC
(``istio_agent.rpc``) has no such side channel, and this keeps it so: here the agent's root
certificate is not the control plane's, and a client opens an ADS stream through the agent's xDS
socket. What the failure says must still reach the log, in the agent's own line.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path

import grpc
from envoy.config.core.v3.base_pb2 import Node

from istio_agent.controlplane.server import ControlPlane
from istio_agent.ctl.local import free_port
from tests.controlplane import started_plane
from tests.security.certs import make_ca, to_pem
from tests.xds import CDS, EnvoyStream

ISTIO_LINE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z\t(debug|info|warn|error|fatal)\t[\w.-]+\t.*")
START = 20.0
NODE = Node(id="sidecar~127.0.0.1~app-1.default~default.svc.cluster.local")


def agent_env(plane: ControlPlane) -> dict[str, str]:
    """A proxyless agent (no Envoy of its own to print) pointed at the control plane's TLS port."""
    proxy_config = {"discoveryAddress": f"127.0.0.1:{plane.secure_port}", "statusPort": free_port()}
    return {
        "PATH": os.environ["PATH"],
        "DISABLE_ENVOY": "true",
        "PROXY_CONFIG": json.dumps(proxy_config),
        "POD_NAME": "app-1",
        "POD_NAMESPACE": "default",
    }


async def wait_for(path: Path, agent: asyncio.subprocess.Process) -> None:
    async with asyncio.timeout(START):
        while not path.exists():
            assert agent.returncode is None, "the agent exited"
            await asyncio.sleep(0.05)


async def test_a_failed_tls_handshake_is_logged_in_istio_format_only(short_tmp: Path, tmp_path: Path) -> None:
    root = short_tmp / "var/run/secrets/istio/root-cert.pem"
    root.parent.mkdir(parents=True)
    root.write_bytes(to_pem(make_ca("not the control plane's CA")[1]))
    async with started_plane(tmp_path) as plane:
        agent = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "istio_agent.cli.pilot_agent",
            "proxy",
            "sidecar",
            cwd=short_tmp,
            env=agent_env(plane),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            socket = short_tmp / "etc/istio/proxy/XDS"
            await wait_for(socket, agent)
            async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
                envoy = EnvoyStream(channel)
                await envoy.send(CDS, node=NODE)
                code, details = await envoy.status()
            assert code == grpc.StatusCode.UNAVAILABLE
            assert "CERTIFICATE_VERIFY_FAILED" in details
        finally:
            if agent.returncode is None:
                agent.send_signal(signal.SIGTERM)
            output, _ = await asyncio.wait_for(agent.communicate(), START)
    lines = output.decode(errors="replace").splitlines()
    assert [line for line in lines if not ISTIO_LINE.fullmatch(line)] == []
    assert any("xdsproxy\t" in line and "CERTIFICATE_VERIFY_FAILED" in line for line in lines)
