"""grpcio's own xDS client and server load the bootstrap the proxyless agent wrote.

The agent runs in-process (no Envoy, no SDS server) with a fake CA and a recording ADS server as
istiod; grpcio runs in its own process (its xDS client reads ``GRPC_XDS_BOOTSTRAP`` once per process).
What grpcio sends through the agent's XDS socket must reach istiod with the bootstrap's node.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from tests.test_agent_proxyless import free_port, running_proxyless
from tests.xds import LDS

pytestmark = pytest.mark.e2e

CLIENT = """
import sys, grpc, grpc.experimental
channel = grpc.secure_channel(sys.argv[1], grpc.xds_channel_credentials(grpc.experimental.insecure_channel_credentials()))
try:
    grpc.channel_ready_future(channel).result(timeout=float(sys.argv[2]))
except grpc.FutureTimeoutError:
    pass
channel.close()
"""

SERVER = """
import sys, time, grpc
from concurrent import futures
server = grpc.server(futures.ThreadPoolExecutor(2), xds=True)
server.add_secure_port(sys.argv[1], grpc.xds_server_credentials(grpc.insecure_server_credentials()))
server.start()
time.sleep(float(sys.argv[2]))
server.stop(None)
"""
REJECTED = "Failed to create xds client"
"""What grpc's C core logs when it refuses a bootstrap (a bad certificate provider config, for one)."""


async def run_grpcio(script: str, bootstrap: Path, *args: str) -> str:
    """Run a grpcio script pointed at ``bootstrap`` as the grpc-agent template's app container is; its stderr."""
    env = {
        **{k: v for k, v in os.environ.items() if k in ("PATH", "HOME")},
        "GRPC_XDS_BOOTSTRAP": str(bootstrap),
        "GRPC_XDS_EXPERIMENTAL_SECURITY_SUPPORT": "true",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, *args, env=env, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await asyncio.wait_for(process.communicate(), 30)
    text = stderr.decode(errors="replace")
    assert process.returncode == 0, text
    return text


async def test_grpcio_client_and_server_accept_the_bootstrap_and_reach_istiod(short_tmp: Path) -> None:
    async with running_proxyless(short_tmp) as agent:
        node = json.loads(agent.bootstrap.read_text())["node"]

        target = "echo.ns.svc.cluster.local:8080"
        stderr = await run_grpcio(CLIENT, agent.bootstrap, f"xds:///{target}", "2")
        assert REJECTED not in stderr, stderr
        client = await agent.istiod.next_stream()
        request = await client.recv()
        assert request.type_url == LDS and list(request.resource_names) == [target]
        assert request.node.id == node["id"]
        assert request.node.metadata.fields["GENERATOR"].string_value == "grpc"
        assert request.node.metadata.fields["NAMESPACE"].string_value == "ns"
        assert request.node.user_agent_name.startswith("gRPC C-core")  # grpcio sent it, not the agent

        port = free_port()
        stderr = await run_grpcio(SERVER, agent.bootstrap, f"127.0.0.1:{port}", "2")
        assert REJECTED not in stderr, stderr
        server = await agent.istiod.next_stream()
        request = await server.recv()
        assert request.type_url == LDS
        assert list(request.resource_names) == [f"xds.istio.io/grpc/lds/inbound/127.0.0.1:{port}"]
        assert request.node.id == node["id"]


async def test_grpcio_refuses_a_broken_certificate_provider(short_tmp: Path) -> None:
    """The control for the test above: grpcio does check the file_watcher config, so accepting ours means something."""
    async with running_proxyless(short_tmp) as agent:
        written = json.loads(agent.bootstrap.read_text())
        written["certificate_providers"]["default"]["config"]["refresh_interval"] = "15 minutes"
        broken = short_tmp / "broken.json"
        broken.write_text(json.dumps(written))
        stderr = await run_grpcio(SERVER, broken, f"127.0.0.1:{free_port()}", "1")
        assert REJECTED in stderr and "refresh_interval" in stderr
        assert agent.istiod.streams.empty()  # nothing reached istiod
