"""SDS benchmark: time from an SDS request to the secret delivered, and CA signing throughput.

    python -m bench.sds [--iterations 40] [--seconds 3]

The local control plane runs as its own process (TLS port, token auth), as istiod would. Each
"cold" sample is a fresh agent (secret manager + CA client + SDS server on a Unix socket) in its
own directory, measured from the moment the DiscoveryRequest for ``default`` is written to the
moment the response is read: key generation, CSR, the CA round trip over a new TLS connection and
the SDS response. "Cached" is a second stream asking for ``default`` once it is cached (what Envoy
sees after a restart or for another listener). Envoy uses this same gRPC stream; the client here is
grpcio so that only the agent is timed.

The Envoy rows put a real Envoy beside that: process start to ``/ready`` = 200 with its mTLS
listener's certificates from a fresh agent over SDS, against the same Envoy with the certificates
inline in its bootstrap (the floor: no agent at all).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc

from istio_agent.config import Env, SecuritySettings
from istio_agent.controlplane.ca import LocalCA
from istio_agent.ctl.local import controlplane_command, free_port, port_open, wait_until
from istio_agent.ctl.static_mtls import mtls_bootstrap
from istio_agent.envoy.binary import find_envoy
from istio_agent.metrics import Registry
from istio_agent.security.caclient import CitadelClient
from istio_agent.security.keys import KeyOptions, generate_csr
from istio_agent.security.manager import SecretManager
from istio_agent.security.sds import SdsServer

SECRET_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
NODE = base_pb2.Node(id="sidecar~127.0.0.1~bench.default~default.svc.cluster.local")
KEY_TYPES = {"ECDSA P-256": {"ECC_SIGNATURE_ALGORITHM": "ECDSA"}, "RSA 2048": {}}


@contextmanager
def control_plane(base: Path) -> Iterator[tuple[Path, int]]:
    mesh = base / "mesh.yaml"
    mesh.write_text("trustDomain: cluster.local\n")
    state = base / "state"
    port, secure = free_port(), free_port()
    process = subprocess.Popen(
        controlplane_command(mesh, state, port, secure, "--log_output_level", "default:warn"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: port_open(secure) and (state / "root-cert.pem").exists(), 20, "the control plane")
        yield state, secure
    finally:
        process.terminate()
        process.wait(10)


def workload_dir(base: Path, state: Path, token: str) -> Path:
    workdir = Path(tempfile.mkdtemp(prefix="w-", dir=base))
    (workdir / "var/run/secrets/istio").mkdir(parents=True)
    shutil.copy(state / "root-cert.pem", workdir / "var/run/secrets/istio/root-cert.pem")
    (workdir / "var/run/secrets/tokens").mkdir(parents=True)
    (workdir / "var/run/secrets/tokens/istio-token").write_text(token)
    return workdir


async def request(socket_path: Path, name: str) -> float:
    """Seconds from writing the SDS request to reading its response."""
    async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
        await channel.channel_ready()
        call = sds_pb2_grpc.SecretDiscoveryServiceStub(channel).StreamSecrets()
        started = time.perf_counter()
        await call.write(
            discovery_pb2.DiscoveryRequest(node=NODE, resource_names=[name], type_url=SECRET_TYPE)
        )
        response = await call.read()
        elapsed = time.perf_counter() - started
        assert len(response.resources) == 1, response
        call.cancel()
    return elapsed


@asynccontextmanager
async def fresh_agent(
    base: Path, state: Path, port: int, token: str, env: dict[str, str]
) -> AsyncIterator[SecuritySettings]:
    """A new agent (secret manager, CA client, SDS server) in its own directory, nothing cached."""
    workdir = workload_dir(base, state, token)
    settings = SecuritySettings.from_env(
        Env({"CA_ADDR": f"127.0.0.1:{port}", "POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "bench", **env}),
        workdir,
    )
    ca = CitadelClient.from_settings(settings, registry=Registry())
    manager = SecretManager(settings, ca, registry=Registry())
    server = SdsServer(manager, settings.sds_socket_path, registry=Registry())
    manager.add_update_callback(server.on_secret_update)
    await manager.start()
    await server.start()
    try:
        yield settings
    finally:
        await server.stop()
        await manager.stop()
        shutil.rmtree(workdir, ignore_errors=True)


async def delivery_samples(
    base: Path, state: Path, port: int, token: str, env: dict[str, str], n: int
) -> tuple[list[float], list[float]]:
    cold, cached = [], []
    for _ in range(n):
        async with fresh_agent(base, state, port, token, env) as settings:
            cold.append(await request(settings.sds_socket_path, "default"))
            cached.append(await request(settings.sds_socket_path, "default"))
    return cold, cached


def envoy_live_seconds(workdir: Path, bootstrap: dict[str, Any], admin_port: int) -> float:
    """Seconds from spawning Envoy to its admin ``/ready`` answering 200 (listeners warmed, secrets in)."""
    (workdir / "envoy.json").write_text(json.dumps(bootstrap))
    started = time.perf_counter()
    process = subprocess.Popen(
        [str(find_envoy()), "-c", "envoy.json", "--use-dynamic-base-id", "--log-level", "error"],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"envoy exited {process.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/ready", timeout=1) as answer:
                    if answer.status == 200:
                        return time.perf_counter() - started
            except OSError:
                pass
            time.sleep(0.005)
    finally:
        process.terminate()
        process.wait(10)


def static_tls(state: Path) -> dict[str, Any]:
    """The same listener TLS context with the certificate inline in the bootstrap (no SDS): the floor."""
    identity = "spiffe://cluster.local/ns/default/sa/bench"
    csr, key = generate_csr(identity, KeyOptions(ecc_signature_algorithm="ECDSA"))
    chain = LocalCA.load_or_create(state, "cluster.local").sign_csr(csr, identity, timedelta(hours=1))
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "require_client_certificate": True,
            "common_tls_context": {
                "tls_certificates": [
                    {
                        "certificate_chain": {"inline_string": "".join(chain)},
                        "private_key": {"inline_string": key.decode()},
                    }
                ],
                "validation_context": {"trusted_ca": {"inline_string": chain[-1]}},
            },
        },
    }


async def envoy_samples(
    base: Path, state: Path, port: int, token: str, n: int
) -> tuple[list[float], list[float]]:
    """Envoy start -> LIVE, certificates over SDS from a fresh agent vs inline in the bootstrap."""
    via_agent, static = [], []
    inline = static_tls(state)
    for _ in range(n):
        admin_port = free_port()
        bootstrap = mtls_bootstrap(NODE.id, "bench.default", admin_port, free_port())
        async with fresh_agent(base, state, port, token, {"ECC_SIGNATURE_ALGORITHM": "ECDSA"}) as settings:
            via_agent.append(
                await asyncio.to_thread(envoy_live_seconds, settings.workdir, bootstrap, admin_port)
            )
        admin_port = free_port()
        bootstrap = mtls_bootstrap(NODE.id, "bench.default", admin_port, free_port())
        listener = bootstrap["static_resources"]["listeners"][0]
        listener["filter_chains"][0]["transport_socket"] = inline
        bootstrap["static_resources"]["clusters"] = []
        workdir = Path(tempfile.mkdtemp(prefix="static-", dir=base))
        static.append(await asyncio.to_thread(envoy_live_seconds, workdir, bootstrap, admin_port))
    return via_agent, static


async def grpc_signing_rate(
    state: Path, port: int, token: str, base: Path, seconds: float, concurrency: int
) -> float:
    workdir = workload_dir(base, state, token)
    settings = SecuritySettings.from_env(
        Env({"CA_ADDR": f"127.0.0.1:{port}", "POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "bench"}), workdir
    )
    client = CitadelClient.from_settings(settings, registry=Registry())
    csrs = [
        generate_csr(settings.spiffe_id, KeyOptions(ecc_signature_algorithm="ECDSA"))[0] for _ in range(32)
    ]
    signed = 0
    deadline = time.perf_counter() + seconds

    async def worker(offset: int) -> None:
        nonlocal signed
        i = offset
        while time.perf_counter() < deadline:
            await client.csr_sign(csrs[i % len(csrs)], timedelta(hours=1))
            signed += 1
            i += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    rate = signed / (time.perf_counter() - started)
    await client.close()
    return rate


def in_process_signing_rate(state: Path, seconds: float) -> float:
    ca = LocalCA.load_or_create(state, "cluster.local")
    identity = "spiffe://cluster.local/ns/default/sa/bench"
    csrs = [generate_csr(identity, KeyOptions(ecc_signature_algorithm="ECDSA"))[0] for _ in range(32)]
    signed = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        ca.sign_csr(csrs[signed % len(csrs)], identity, timedelta(hours=1))
        signed += 1
    return signed / (time.perf_counter() - started)


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000


async def main_async(iterations: int, seconds: float) -> None:
    base = Path(tempfile.mkdtemp(prefix="bench-sds-", dir="/tmp"))
    try:
        with control_plane(base) as (state, port):
            from istio_agent.controlplane.tokens import mint_token

            token = mint_token(state, "default", "bench")
            rows = []
            for label, env in KEY_TYPES.items():
                await delivery_samples(base, state, port, token, env, 3)  # warm-up: imports, first TLS
                cold, cached = await delivery_samples(base, state, port, token, env, iterations)
                rows.append((f"first `default` ({label}): request -> delivered", cold))
                rows.append((f"cached `default` ({label}): request -> delivered", cached))
            envoy_sds, envoy_static = await envoy_samples(base, state, port, token, max(5, iterations // 3))
            rows.append(("Envoy start -> LIVE, certs over SDS from a fresh agent (ECDSA)", envoy_sds))
            rows.append(("Envoy start -> LIVE, certs inline in the bootstrap (floor)", envoy_static))
            grpc_rate = await grpc_signing_rate(state, port, token, base, seconds, concurrency=8)
            local_rate = in_process_signing_rate(state, seconds)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    print(f"SDS delivery, {iterations} fresh agents per key type (ms)\n")
    print(f"| {'measurement':<64} | {'p50':>7} | {'p99':>7} | {'mean':>7} |")
    print(f"|{'-' * 66}|{'-' * 9}|{'-' * 9}|{'-' * 9}|")
    for label, samples in rows:
        print(
            f"| {label:<64} | {pct(samples, 0.5):7.2f} | {pct(samples, 0.99):7.2f} | "
            f"{statistics.mean(samples) * 1000:7.2f} |"
        )
    print("\nLocal CA signing throughput (ECDSA P-256 CSRs)\n")
    print(f"| {'path':<58} | {'certs/s':>9} |")
    print(f"|{'-' * 60}|{'-' * 11}|")
    print(f"| {'gRPC over TLS, token auth, 8 concurrent (CitadelClient)':<58} | {grpc_rate:9.0f} |")
    print(f"| {'in-process LocalCA.sign_csr':<58} | {local_rate:9.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    asyncio.run(main_async(args.iterations, args.seconds))


if __name__ == "__main__":
    main()
