"""Wasm module fetching: the agent's fetchers against the tools a node would use, and the ECDS conversion.

    python -m bench.wasm [--size-mb 16] [--rounds 7]

Rows, each measured ``--rounds`` times with the agent and its peer alternated (p50 reported):

* **HTTP**: a module served by busybox's httpd (C) on loopback, fetched by the agent's
  ``HttpFetcher`` (in the agent's process, as it runs) against ``curl -o FILE`` (a process per fetch;
  its start-up is in its time, shown by the small-module row);
* **OCI**: the module as an OCI Wasm artifact in Debian's docker-registry (CNCF distribution),
  pulled by the agent's ``ImageFetcher`` (manifest + blob, digests checked) against ``skopeo copy``
  (containers/image, Go) into an OCI layout directory;
* **ECDS conversion, warm cache**: one ECDS response with one remote Wasm filter converted to the
  cached local file (what every push of a known plugin costs the agent), against decoding and
  re-encoding the same response without conversion.

Both sizes: ``--size-mb`` and the 1 KB test filter size, so the fixed cost and the throughput show.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from envoy.config.core.v3 import extension_pb2
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2

from istio_agent.config.wasm import WasmSettings
from istio_agent.metrics import Registry
from istio_agent.wasm.cache import ModuleCache
from istio_agent.wasm.convert import EcdsConverter
from istio_agent.wasm.httpfetch import HttpFetcher
from istio_agent.wasm.metrics import WasmMetrics
from istio_agent.wasm.oci import ImageFetcher
from istio_agent.wasm.options import GetOptions
from istio_agent.wasm.ssrf import DialGuard
from tests.wasm.registry import ARTIFACT, push_wasm, running_registry

SMALL = 1024


def module_of(size: int) -> bytes:
    """A Wasm header and ``size`` bytes in all (the fetchers check only the magic and the sha256)."""
    header = b"\0asm\x01\x00\x00\x00"
    return header + os.urandom(max(0, size - len(header)))


def p50_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


async def timed(run: Callable[[], Awaitable[object]]) -> float:
    started = time.perf_counter()
    await run()
    return time.perf_counter() - started


def run_tool(args: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(args, check=True, capture_output=True)
    return time.perf_counter() - started


class Httpd:
    """busybox httpd serving a directory on 127.0.0.1."""

    def __init__(self, root: Path) -> None:
        from istio_agent.ctl.local import free_port, port_open, wait_until

        self.port = free_port()
        self.process = subprocess.Popen(
            ["busybox", "httpd", "-f", "-p", f"127.0.0.1:{self.port}", "-h", str(root)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(lambda: port_open(self.port), 10, "busybox httpd to listen")

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(5)


async def bench_http(sizes: list[int], rounds: int, work: Path) -> list[tuple[str, float, float]]:
    rows = []
    root = work / "www"
    root.mkdir()
    for size in sizes:
        (root / f"m{size}.wasm").write_bytes(module_of(size))
    httpd = Httpd(root)
    settings = WasmSettings(cache_dir=work / "cache", max_binary_bytes=max(sizes) + 1)
    fetcher = HttpFetcher(settings, DialGuard())
    try:
        for size in sizes:
            url = httpd.url(f"m{size}.wasm")
            agent, curl = [], []
            for _ in range(rounds):
                agent.append(await timed(functools.partial(fetcher.fetch, url, timeout=60)))
                curl.append(run_tool(["curl", "-sSf", "-o", str(work / "curl.out"), url]))
            rows.append((f"HTTP, {_size(size)}", p50_ms(agent), p50_ms(curl)))
    finally:
        httpd.stop()
    return rows


async def bench_oci(sizes: list[int], rounds: int, work: Path) -> list[tuple[str, float, float]]:
    rows = []
    with running_registry() as registry:
        for size in sizes:
            repo = f"bench/m{size}"
            push_wasm(registry, repo, "v1", module_of(size), ARTIFACT)
            reference = registry.reference(repo, "v1")
            agent, skopeo = [], []

            for round_ in range(rounds):
                agent.append(await timed(functools.partial(_pull, reference, size + 1)))
                target = work / f"skopeo-{size}-{round_}"
                skopeo.append(
                    run_tool(
                        [
                            "skopeo",
                            "copy",
                            "--src-tls-verify=false",
                            f"docker://{reference}",
                            f"oci:{target}:v1",
                        ]
                    )
                )
                shutil.rmtree(target)
            rows.append((f"OCI artifact, {_size(size)}", p50_ms(agent), p50_ms(skopeo)))
    return rows


async def _pull(reference: str, max_bytes: int) -> bytes:
    """One pull as the cache makes it: a fresh fetcher, the manifest, then the module."""
    fetcher = ImageFetcher(guard=DialGuard(), max_bytes=max_bytes, insecure=True, pull_secret=None)
    prepared = await fetcher.prepare(reference)
    return await prepared.fetch()


async def bench_conversion(rounds: int, work: Path) -> tuple[float, float]:
    """Per ECDS response: conversion with the module cached, and a plain decode + encode."""
    module = module_of(SMALL)
    root = work / "www-ecds"
    root.mkdir()
    (root / "filter.wasm").write_bytes(module)
    httpd = Httpd(root)
    settings = WasmSettings(cache_dir=work / "cache-ecds")
    metrics = WasmMetrics(Registry())
    cache = ModuleCache(settings, metrics)
    await cache.start()
    try:
        url = httpd.url("filter.wasm")
        await cache.get(url, GetOptions(checksum=hashlib.sha256(module).hexdigest()))  # warm it
        converter = EcdsConverter(cache, metrics)
        encoded = _ecds_response(url, hashlib.sha256(module).hexdigest()).SerializeToString()
        per_call = 200
        converted, plain = [], []
        for _ in range(rounds):

            async def convert_all() -> None:
                for _ in range(per_call):
                    response = discovery_pb2.DiscoveryResponse.FromString(encoded)
                    resources = await converter.convert(list(response.resources))
                    del response.resources[:]
                    response.resources.extend(resources)
                    response.SerializeToString()

            async def plain_all() -> None:
                for _ in range(per_call):
                    discovery_pb2.DiscoveryResponse.FromString(encoded).SerializeToString()

            converted.append(await timed(convert_all) / per_call)
            plain.append(await timed(plain_all) / per_call)
    finally:
        await cache.stop()
        httpd.stop()
    return statistics.median(converted) * 1e6, statistics.median(plain) * 1e6


def _ecds_response(url: str, sha256: str) -> discovery_pb2.DiscoveryResponse:
    wasm = wasm_pb2.Wasm()
    vm = wasm.config.vm_config
    vm.runtime = "envoy.wasm.runtime.v8"
    vm.code.remote.http_uri.uri = url
    vm.code.remote.http_uri.cluster = "_"
    vm.code.remote.http_uri.timeout.FromSeconds(30)
    vm.code.remote.sha256 = sha256
    vm.environment_variables.key_values["ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION"] = "1"
    typed = any_pb2.Any()
    typed.Pack(wasm)
    resource = any_pb2.Any()
    resource.Pack(
        extension_pb2.TypedExtensionConfig(
            name="extensions.istio.io/wasmplugin/default.p", typed_config=typed
        )
    )
    return discovery_pb2.DiscoveryResponse(
        type_url=resource.type_url, version_info="v1", nonce="n", resources=[resource]
    )


def _size(size: int) -> str:
    return f"{size // (1024 * 1024)} MB" if size >= 1024 * 1024 else f"{size // 1024} KB"


async def main_async(size_mb: int, rounds: int) -> None:
    sizes = [SMALL, size_mb * 1024 * 1024]
    with tempfile.TemporaryDirectory(prefix="bench-wasm-") as tmp:
        work = Path(tmp)
        rows = await bench_http(sizes, rounds, work)
        rows += await bench_oci(sizes, rounds, work)
        converted, plain = await bench_conversion(rounds, work)
    print(
        f"Wasm module fetch, p50 of {rounds} alternated rounds (agent in process; peers are one process each)"
    )
    print(f"{'':<24} {'agent ms':>10} {'peer ms':>10} {'agent/peer':>11}  peer")
    for name, agent, peer in rows:
        tool = "curl" if name.startswith("HTTP") else "skopeo copy"
        print(f"{name:<24} {agent:>10.1f} {peer:>10.1f} {agent / peer:>10.2f}x  {tool}")
    print()
    print("ECDS response with one remote Wasm filter, module cached (per response)")
    print(f"  converted to the local file: {converted:8.1f} us")
    print(f"  decoded and re-encoded only: {plain:8.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mb", type=int, default=16, help="the large module's size (default 16)")
    parser.add_argument("--rounds", type=int, default=7, help="alternated rounds per row (default 7)")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main_async(args.size_mb, args.rounds))


if __name__ == "__main__":
    main()
