"""bench.dns_legs's servers report both legs of forwarded queries (so the bench keeps measuring the
agent after a change to its DNS path rather than printing nothing)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys

import dns.message
import pytest

from istio_agent.ctl.local import free_port
from tests.dns.test_upstream import FakeUpstream, answer


@pytest.mark.parametrize("kind", ["agent", "yardstick"])
async def test_a_server_reports_the_python_time_of_both_legs(kind: str) -> None:
    upstream = FakeUpstream(answer("10.0.0.1"))
    await upstream.start()
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.dns_legs", "--serve", kind, "127.0.0.1", str(upstream.port), str(port),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        assert (await asyncio.wait_for(process.stdout.readline(), 20)).strip() == b"ready"

        def ask_ten() -> list[int]:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
                client.settimeout(3)
                ids = []
                for i in range(10):
                    client.sendto(
                        dns.message.make_query(f"n{i}.example.", "A", id=i).to_wire(), ("127.0.0.1", port)
                    )
                    ids.append(dns.message.from_wire(client.recv(4096)).id)
                return ids

        assert await asyncio.to_thread(ask_ten) == list(range(10))
        process.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(process.communicate(), 10)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await upstream.stop()
    legs = json.loads(out.decode().strip().splitlines()[-1])
    assert 0 < legs["query"] < 10_000 and 0 < legs["reply"] < 10_000  # µs
