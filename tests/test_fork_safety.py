"""Spawning children from a busy agent process must not crash them.

grpcio's fork handlers once killed 1.6 % of the children the agent forked while gRPC was busy
(Envoy now and then, at start-up); the agent's gRPC is now :mod:`istio_agent.rpc` (grpclib, pure
Python), which has none. This keeps the agent's own stack, busy on both ends, honest about it,
with Envoy's parent-death hook run between fork and exec.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

STRESS = textwrap.dedent(
    """
    import asyncio, sys
    import uvloop
    from istio_agent.envoy.process import die_with_parent
    from istio_agent.rpc.channel import Channel
    from istio_agent.rpc.server import RpcServer

    async def main(spawns, hook):
        server = RpcServer()

        async def echo(request, call):
            return request

        server.add_unary("/t.T/E", echo, bytes, bytes)
        await server.start(host="127.0.0.1", port=0)
        port = server.sockets()[0].getsockname()[1]
        channel = Channel(f"127.0.0.1:{port}")
        busy = True

        async def load():
            while busy:
                await asyncio.gather(*(channel.unary("/t.T/E", b"x" * 100, bytes) for _ in range(20)))

        loads = [asyncio.ensure_future(load()) for _ in range(4)]
        crashed = 0
        for _ in range(spawns):
            extra = {"preexec_fn": die_with_parent()} if hook else {}
            child = await asyncio.create_subprocess_exec("/bin/true", **extra)
            crashed += await child.wait() != 0
        busy = False
        await asyncio.gather(*loads)
        channel.close()
        await server.stop(0)
        print(crashed)
        print("grpc" in sys.modules)

    uvloop.run(main(int(sys.argv[1]), sys.argv[2] == "hook"))
    """
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spawn", ["plain", "hook"])
def test_children_of_a_busy_agent_do_not_crash(spawn: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", STRESS, "500", spawn], capture_output=True, text=True, timeout=110, check=True
    )
    assert done.stdout.split() == ["0", "False"], done.stdout + done.stderr[-2000:]
