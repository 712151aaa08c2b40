"""Importing the agent's packages does no work: no environment edits, no grpc, no eager re-exports.

Each check runs in a fresh interpreter without the variables the test process's conftest sets, so
an import that edits the environment or loads grpc is seen.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PROBE = textwrap.dedent(
    """
    import json, os, sys
    before = dict(os.environ)
    import {module}
    print(json.dumps({{
        "environ_changed": sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)),
        "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("grpc", "istio_agent", "cryptography")),
    }}))
    """
)


def imported(module: str) -> dict[str, list[str]]:
    """What importing ``module`` changed in the environment and which modules it loaded."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=30,
    )
    result: dict[str, list[str]] = json.loads(done.stdout)
    return result


@pytest.mark.parametrize(
    "module",
    ["istio_agent.cli", "istio_agent.cli.pilot_agent", "istio_agent.cli.agentctl", "istio_agent.xds"],
)
def test_importing_does_not_edit_the_environment(module: str) -> None:
    assert imported(module)["environ_changed"] == []


@pytest.mark.parametrize(
    "module", ["istio_agent.cli.pilot_agent", "istio_agent.cli.agentctl", "istio_agent.cli.install_cni"]
)
def test_a_command_loads_no_grpc_before_its_main_prepares_the_process(module: str) -> None:
    # No command needs grpcio (src/ imports none: tests/test_no_grpcio_in_src.py); importing one loads none.
    loaded = imported(module)["loaded"]
    assert [name for name in loaded if name.startswith("grpc")] == []


def test_the_agent_module_loads_neither_grpc_nor_the_certificate_code() -> None:
    # Envoy starts before the servers and the CA client are needed: their imports come after it.
    loaded = imported("istio_agent.agent")["loaded"]
    heavy = ("grpc", "cryptography", "istio_agent.security.sds", "istio_agent.xds.proxy", "istio_agent.pem")
    assert [name for name in loaded if name.startswith(heavy)] == []


def test_the_xds_flavours_load_neither_the_proxy_nor_the_dialer_nor_pem() -> None:
    loaded = imported("istio_agent.xds.flavour")["loaded"]
    assert "istio_agent.xds.proxy" not in loaded
    assert "istio_agent.xds.upstream" not in loaded
    assert "istio_agent.pem" not in loaded


def test_pilot_agent_main_leaves_grpcs_environment_alone() -> None:
    # No grpcio in the agent: nothing to prepare for it (its fork handlers, its C-core log), and
    # variables set for it would only reach Envoy and exec probes.
    script = textwrap.dedent(
        """
        import os, sys
        from istio_agent.cli import pilot_agent
        sys.argv = ["pilot-agent", "version", "-s"]
        try:
            pilot_agent.main()
        except SystemExit:
            pass
        print(sorted(k for k in os.environ if k.startswith("GRPC_")))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True, timeout=30
    )
    assert done.stdout.splitlines()[-1] == "[]"


AGENT_RUN = textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    import istio_agent.cli.pilot_agent
    from istio_agent.agent import Agent, AgentSettings
    from istio_agent.config import Env, SecuritySettings, XdsSettings
    from istio_agent.metrics import Registry

    async def main() -> None:
        work = Path(sys.argv[1])
        env = Env({"POD_NAMESPACE": "ns", "SERVICE_ACCOUNT": "sa", "CA_ADDR": "127.0.0.1:15010"})  # plaintext
        security = SecuritySettings.from_env(env, work)
        xds = XdsSettings(socket_path=work / "XDS", discovery_address="127.0.0.1:1", plaintext=True)
        agent = Agent(AgentSettings(security=security, xds=xds), registry=Registry())
        await agent.start()
        try:
            # Envoy's first stream through the proxy: the upstream is dialled (and refused).
            from istio_agent.rpc.channel import Channel
            from envoy.service.discovery.v3 import discovery_pb2
            channel = Channel(f"unix:{xds.socket_path}")
            stream = channel.stream(
                "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources",
                discovery_pb2.DiscoveryRequest, bytes,
            )
            await stream.send(discovery_pb2.DiscoveryRequest(type_url="x"))
            try:
                await stream.recv()
            except Exception as err:
                print("stream ended:", err, file=sys.stderr)
            channel.close()
        finally:
            await agent.stop()

    asyncio.run(main())
    never = set(sys.argv[2:])
    print(json.dumps(sorted(m for m in sys.modules if m in never or m.split(".")[0] in never)))
    """
)

RUNNING_AGENT_NEVER_LOADS = (
    "grpc",  # the agent's gRPC is grpclib (istio_agent.rpc)
    "click",  # pilot-agent's flags are argparse (cli/flags.py)
    "cryptography",  # certificates through pem/ and the libcrypto ssl loaded
    "email",  # the HTTP Date header is http.server's own
    "secrets",  # temporary names and nonces from os.urandom
    "uuid",
    "tempfile",
    "shutil",  # only when Envoy is looked up on PATH
    "ctypes.util",  # find_library spawns ldconfig
    "istio_agent.wasm.convert",  # with the module cache and Envoy's Wasm and RBAC protos, ~2.9 MB:
    "istio_agent.wasm.cache",  # built at the first ECDS response (xds/extension_configs.py)
)
"""Modules a running pilot-agent does not load: each was measured in its idle RSS (issue 23)."""


def test_a_running_agent_loads_none_of_what_it_does_without(short_tmp: Path) -> None:
    """SDS, the xDS proxy both ways and the CA client running: none of RUNNING_AGENT_NEVER_LOADS."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    done = subprocess.run(
        [sys.executable, "-c", AGENT_RUN, str(short_tmp), *RUNNING_AGENT_NEVER_LOADS],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "stream ended" in done.stderr  # the proxy did dial istiod (refused)
    assert json.loads(done.stdout.splitlines()[-1]) == []
