"""The Wasm module cache: Istio's ``pkg/wasm/cache_test.go`` cases that apply, and what we add
(the cache survives a restart, one fetch for concurrent requests, an unwritable directory).

HTTP modules come from a real local server (aiohttp) through the real HTTP fetcher; OCI images from
a fake image fetcher (the real one is tested against a real registry in ``test_oci.py``), so each
case can count manifest and blob requests.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest
from aiohttp import web

from istio_agent.config.wasm import WasmSettings
from istio_agent.metrics import Registry
from istio_agent.wasm import metrics
from istio_agent.wasm.cache import GetOptions, ModuleCache, PullPolicy, module_name
from istio_agent.wasm.errors import FetchError
from istio_agent.wasm.httpfetch import HttpFetcher
from istio_agent.wasm.metrics import WasmMetrics
from istio_agent.wasm.ssrf import DialGuard
from tests.envoy.test_supervisor import eventually
from tests.http.aioserver import Serve, aio_fixture  # noqa: F401  (the "aio" fixture)

HEADER = b"\0asm\x01\0\0\0"
MODULE = HEADER + b"data"
OTHER = MODULE + b"different data"
INVALID = b"invalid binary"
OCI_MODULE = HEADER + b"this is wasm plugin"
OCI_MODULE_2 = HEADER + b"this is wasm plugin, v2"
DIGEST = hashlib.sha256(b"manifest v1").hexdigest()
DIGEST_2 = hashlib.sha256(b"manifest v2").hexdigest()
REGISTRY = "registry.example:5000"
TAGGED = f"oci://{REGISTRY}/test/valid/docker:v0.1.0"
LATEST = f"oci://{REGISTRY}/test/valid/docker:latest"
UNTAGGED = f"oci://{REGISTRY}/test/valid/docker"
BY_DIGEST = f"oci://{REGISTRY}/test/valid/docker@sha256:{DIGEST}"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class FakeImage:
    digest: str
    module: bytes
    index_digest: str | None = None
    """The index the reference named, when it named one (``digest`` is then its chosen image's)."""


@dataclass
class FakeRegistry:
    """Stands in for ``istio_agent.wasm.oci.ImageFetcher``: images by reference, requests counted."""

    images: dict[str, FakeImage] = field(default_factory=dict)
    prepared: list[str] = field(default_factory=list)
    fetched: list[str] = field(default_factory=list)
    fetchers: list[dict[str, object]] = field(default_factory=list)
    manifest_error: bool = False
    blob_error: bool = False
    hang: bool = False
    """The manifest request never answers."""

    def fetcher(
        self, *, guard: DialGuard, max_bytes: int, insecure: bool, pull_secret: bytes | None
    ) -> FakeImageFetcher:
        self.fetchers.append({"insecure": insecure, "pull_secret": pull_secret, "max_bytes": max_bytes})
        return FakeImageFetcher(self)

    @property
    def visited(self) -> int:
        return len(self.prepared) + len(self.fetched)


class FakeImageFetcher:
    def __init__(self, registry: FakeRegistry) -> None:
        self.registry = registry

    async def prepare(self, reference: str) -> FakePrepared:
        self.registry.prepared.append(reference)
        if self.registry.hang:
            await asyncio.sleep(3600)
        if self.registry.manifest_error:
            raise FetchError(f"could not fetch manifest of {reference}", metrics.MANIFEST_FAILURE)
        _, _, digest = reference.partition("@sha256:")
        if digest:
            image = next(i for i in self.registry.images.values() if digest in (i.digest, i.index_digest))
        else:
            image = self.registry.images[reference]
        return FakePrepared(self.registry, reference, image)


class FakePrepared:
    def __init__(self, registry: FakeRegistry, reference: str, image: FakeImage) -> None:
        self.registry = registry
        self.reference = reference
        self.digest = image.digest
        self.index_digest = image.index_digest
        self.image = image

    async def fetch(self) -> bytes:
        self.registry.fetched.append(self.reference)
        if self.registry.blob_error:
            raise FetchError("could not fetch the blob", metrics.DOWNLOAD_FAILURE)
        return self.image.module


@dataclass
class Server:
    url: str
    requests: list[str]
    gate: asyncio.Event
    """``/slow`` answers once this is set."""

    async def asked(self, count: int = 1) -> None:
        """Wait until the server has had ``count`` requests."""
        for _ in range(500):
            if len(self.requests) >= count:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"the server had {len(self.requests)} requests, expected {count}")


@pytest.fixture(name="server")
async def server_fixture(aio: Serve) -> Server:
    """Istio's test server: ``/different-url`` and ``/invalid-wasm-header`` differ, the rest is MODULE."""
    requests: list[str] = []
    gate = asyncio.Event()

    async def handle(request: web.Request) -> web.Response:
        requests.append(request.path)
        if request.path == "/slow":
            await gate.wait()
        if request.path == "/different-url":
            return web.Response(body=OTHER)
        if request.path == "/invalid-wasm-header":
            return web.Response(body=INVALID)
        return web.Response(body=MODULE)

    port = await aio(handle)
    return Server(f"http://127.0.0.1:{port}", requests, gate)


@dataclass
class Harness:
    tmp: Path
    registry: Registry
    oci: FakeRegistry
    caches: list[ModuleCache] = field(default_factory=list)

    async def cache(self, **settings: object) -> ModuleCache:
        merged: dict[str, object] = {"cache_dir": self.tmp / "data"} | settings
        config = WasmSettings(**merged)  # type: ignore[arg-type]
        guard = DialGuard(config.blocked_networks)
        cache = ModuleCache(
            config,
            WasmMetrics(self.registry),
            http_fetcher=HttpFetcher(config, guard, initial_backoff=0.001),
            image_fetcher=self.oci.fetcher,
        )
        await cache.start()
        self.caches.append(cache)
        return cache

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.sample(f"istio_agent_{name}", labels or None) or 0.0

    def files(self) -> list[Path]:
        """The module files (not the URL index)."""
        root = self.tmp / "data"
        return sorted(root.rglob("*.wasm")) if root.exists() else []


@pytest.fixture(name="harness")
async def harness_fixture(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = Harness(tmp_path, Registry(), FakeRegistry())
    harness.oci.images[TAGGED.removeprefix("oci://")] = FakeImage(DIGEST, OCI_MODULE)
    harness.oci.images[LATEST.removeprefix("oci://")] = FakeImage(DIGEST, OCI_MODULE)
    harness.oci.images[UNTAGGED.removeprefix("oci://")] = FakeImage(DIGEST, OCI_MODULE)
    yield harness
    for cache in harness.caches:
        await cache.stop()


def opts(**kw: object) -> GetOptions:
    return GetOptions(**{"timeout": 10.0} | kw)  # type: ignore[arg-type]


def expected_path(harness: Harness, url: str, checksum: str) -> Path:
    return harness.tmp / "data" / sha(module_name(url).encode()) / f"{checksum}.wasm"


def test_module_name() -> None:
    """The URL, or for OCI the repository without tag or digest (so all tags share a directory)."""
    assert module_name("http://host/a.wasm?x=1") == "http://host/a.wasm?x=1"
    assert module_name(TAGGED) == f"oci://{REGISTRY}/test/valid/docker"
    assert module_name(BY_DIGEST) == f"oci://{REGISTRY}/test/valid/docker"
    assert module_name(UNTAGGED) == f"oci://{REGISTRY}/test/valid/docker"
    assert module_name(f"oci://{REGISTRY}/a/b:t@sha256:{DIGEST}") == f"oci://{REGISTRY}/a/b"


def test_pull_policy_names() -> None:
    assert PullPolicy.from_env_value("IfNotPresent") is PullPolicy.IF_NOT_PRESENT
    assert PullPolicy.from_env_value("Always") is PullPolicy.ALWAYS
    assert PullPolicy.from_env_value("") is PullPolicy.UNSPECIFIED


async def test_cache_miss_then_hit(harness: Harness, server: Server) -> None:
    cache = await harness.cache()
    checksum = sha(MODULE)
    path = await cache.get(server.url, opts(checksum=checksum, resource_name="ns.res", resource_version="0"))
    assert path == expected_path(harness, server.url, checksum)
    assert path.read_bytes() == MODULE
    assert path.stat().st_mode & 0o777 == 0o644
    assert server.requests == ["/"]
    assert harness.sample("wasm_cache_lookup_count", hit="false") == 1
    assert harness.sample("wasm_remote_fetch_count", result="success") == 1
    assert harness.sample("wasm_cache_entries") == 1

    again = await cache.get(server.url, opts(checksum=checksum, resource_name="ns.res", resource_version="0"))
    assert again == path
    assert server.requests == ["/"]
    assert harness.sample("wasm_cache_lookup_count", hit="true") == 1


async def test_hit_updates_last_use(harness: Harness, server: Server) -> None:
    cache = await harness.cache()
    path = await cache.get(server.url, opts(checksum=sha(MODULE)))
    os.utime(path, (1, 1))
    await cache.get(server.url, opts(checksum=sha(MODULE)))
    assert path.stat().st_mtime > time.time() - 60


async def test_invalid_scheme(harness: Harness) -> None:
    cache = await harness.cache()
    with pytest.raises(FetchError, match=r"^unsupported Wasm module downloading URL scheme: foo"):
        await cache.get("foo://abc", opts(checksum=sha(MODULE)))
    assert harness.files() == []


async def test_download_failure(harness: Harness) -> None:
    cache = await harness.cache(http_max_retries=2)
    with pytest.raises(FetchError, match="download failed after 2 attempts") as caught:
        await cache.get("http://127.0.0.1:1/m.wasm", opts())
    assert caught.value.reason == metrics.DOWNLOAD_FAILURE
    assert harness.sample("wasm_remote_fetch_count", result="download_failure") == 1
    assert harness.files() == []


async def test_wrong_checksum(harness: Harness, server: Server) -> None:
    cache = await harness.cache()
    with pytest.raises(FetchError) as caught:
        await cache.get(server.url, opts(checksum="wrongchecksum\n"))
    assert str(caught.value).startswith(
        f"module downloaded from {server.url} has checksum {sha(MODULE)}, which does not match"
    )
    assert caught.value.reason == metrics.CHECKSUM_MISMATCH
    assert harness.sample("wasm_remote_fetch_count", result="checksum_mismatched") == 1
    assert harness.files() == []


async def test_checksum_case_does_not_matter(harness: Harness, server: Server) -> None:
    cache = await harness.cache()
    path = await cache.get(server.url, opts(checksum=sha(MODULE).upper()))
    assert path.name == f"{sha(MODULE)}.wasm"


async def test_different_url_same_checksum(harness: Harness, server: Server) -> None:
    """A URL changed without its checksum: the download still happens, and fails the check."""
    cache = await harness.cache()
    await cache.get(server.url, opts(checksum=sha(MODULE)))
    with pytest.raises(FetchError, match=f"module downloaded from {server.url}/different-url has checksum"):
        await cache.get(server.url + "/different-url", opts(checksum=sha(MODULE)))
    assert server.requests == ["/", "/different-url"]
    assert len(harness.files()) == 1


async def test_invalid_wasm_header(harness: Harness, server: Server) -> None:
    cache = await harness.cache()
    url = server.url + "/invalid-wasm-header"
    with pytest.raises(FetchError, match=f"fetched Wasm binary from {url} is invalid") as caught:
        await cache.get(url, opts(checksum=sha(INVALID)))
    assert caught.value.reason == metrics.FETCH_FAILURE
    assert harness.files() == []


async def test_without_checksum_uses_the_downloaded_one(harness: Harness, server: Server) -> None:
    cache = await harness.cache()
    path = await cache.get(server.url, opts(resource_name="ns.res", resource_version="1"))
    assert path == expected_path(harness, server.url, sha(MODULE))
    assert await cache.get(server.url, opts(resource_name="ns.res", resource_version="2")) == path
    assert server.requests == ["/"]


async def test_purge_on_expiry(harness: Harness, server: Server) -> None:
    cache = await harness.cache(
        purge_interval=timedelta(milliseconds=10), module_expiry=timedelta(milliseconds=10)
    )
    await cache.get(server.url, opts())
    assert len(harness.files()) == 1
    await eventually(lambda: harness.files() == [], "the purge", timeout=3)
    assert harness.sample("wasm_cache_entries") == 0
    index = harness.tmp / "data" / "urls.json"  # the URL's record goes with its module (written after)
    await eventually(lambda: json.loads(index.read_text())["urls"] == {}, "the index to forget the URL")
    await cache.get(server.url, opts())
    assert server.requests == ["/", "/"]


async def test_purge_keeps_modules_in_use(harness: Harness, server: Server) -> None:
    cache = await harness.cache(
        purge_interval=timedelta(milliseconds=10), module_expiry=timedelta(seconds=30)
    )
    await cache.get(server.url, opts())
    await asyncio.sleep(0.1)
    assert len(harness.files()) == 1


async def test_zero_expiry_is_the_default(harness: Harness, server: Server) -> None:
    """As Istio's options: WASM_MODULE_EXPIRY=0 is the default (24h), not "expire at once"."""
    cache = await harness.cache(purge_interval=timedelta(milliseconds=10), module_expiry=timedelta(0))
    await cache.get(server.url, opts())
    await asyncio.sleep(0.1)
    assert len(harness.files()) == 1


async def test_purge_removes_the_checksums_of_every_url_of_the_module(harness: Harness) -> None:
    """Istio's "purge OCI image on expiry": tag and digest URLs of one repository go together."""
    cache = await harness.cache(
        purge_interval=timedelta(milliseconds=10), module_expiry=timedelta(milliseconds=50)
    )
    await cache.get(TAGGED, opts())
    await cache.get(BY_DIGEST, opts())
    assert len(harness.files()) == 1
    await eventually(lambda: harness.files() == [], "the purge", timeout=3)
    harness.oci.prepared.clear()
    await cache.get(TAGGED, opts())
    assert harness.oci.prepared == [TAGGED.removeprefix("oci://")]


# --- OCI and pull policies (Istio's cases, with the fake image fetcher) ---


async def test_fetch_oci_without_digest(harness: Harness) -> None:
    cache = await harness.cache()
    path = await cache.get(TAGGED, opts(resource_name="ns.res", resource_version="0"))
    assert path == expected_path(harness, TAGGED, DIGEST)
    assert path.read_bytes() == OCI_MODULE
    assert harness.oci.prepared == [f"{REGISTRY}/test/valid/docker:v0.1.0"]
    assert harness.oci.fetched == harness.oci.prepared


async def test_fetch_oci_with_digest(harness: Harness) -> None:
    cache = await harness.cache()
    path = await cache.get(BY_DIGEST, opts(resource_name="ns.res", resource_version="0"))
    assert path == expected_path(harness, TAGGED, DIGEST)  # the tag's directory: one per repository
    assert harness.oci.prepared == [BY_DIGEST.removeprefix("oci://")]


async def test_cache_hit_for_oci_url_with_digest(harness: Harness) -> None:
    """No checksum given: the URL's digest is the checksum, so a cached module is used untouched."""
    cache = await harness.cache()
    first = await cache.get(TAGGED, opts())
    harness.oci.prepared.clear()
    assert await cache.get(BY_DIGEST, opts(resource_name="ns.res", resource_version="9")) == first
    assert harness.oci.visited == 1  # only the first get's blob


async def test_cache_hit_for_tagged_oci_url_without_digest(harness: Harness) -> None:
    cache = await harness.cache()
    first = await cache.get(TAGGED, opts(resource_name="ns.res", resource_version="0"))
    assert await cache.get(TAGGED, opts(resource_name="ns.res", resource_version="1")) == first
    assert len(harness.oci.prepared) == 1


async def test_cache_miss_for_another_tag(harness: Harness) -> None:
    """Another tag of a cached repository: its manifest is asked, and its digest finds the module."""
    cache = await harness.cache()
    first = await cache.get(TAGGED, opts())
    other = f"{REGISTRY}/test/valid/docker:v0.2.0"
    harness.oci.images[other] = FakeImage(DIGEST, OCI_MODULE)
    assert await cache.get(f"oci://{other}", opts()) == first
    assert harness.oci.prepared == [TAGGED.removeprefix("oci://"), other]
    assert harness.oci.fetched == [TAGGED.removeprefix("oci://")]  # blob not downloaded again


async def pull(
    cache: ModuleCache,
    version: str,
    policy: PullPolicy = PullPolicy.UNSPECIFIED,
    *,
    url: str = TAGGED,
    resource: str = "ns.res",
    checksum: str = "",
) -> Path:
    """``cache.get`` as the plugin ``resource`` at resource ``version`` with ``policy`` asks it."""
    options = opts(resource_name=resource, resource_version=version, pull_policy=policy, checksum=checksum)
    return await cache.get(url, options)


ALWAYS = PullPolicy.ALWAYS
IF_NOT_PRESENT = PullPolicy.IF_NOT_PRESENT


async def test_pull_always_when_resource_version_changes(harness: Harness) -> None:
    cache = await harness.cache()
    first = await pull(cache, "123456")
    assert await pull(cache, "0", ALWAYS) == first
    assert len(harness.oci.prepared) == 2  # the manifest again...
    assert len(harness.oci.fetched) == 1  # ...but its digest hits the cache: no blob


async def test_pull_always_fetches_a_changed_image(harness: Harness) -> None:
    cache = await harness.cache()
    first = await pull(cache, "1")
    harness.oci.images[TAGGED.removeprefix("oci://")] = FakeImage(DIGEST_2, OCI_MODULE_2)
    second = await pull(cache, "2", ALWAYS)
    assert second == expected_path(harness, TAGGED, DIGEST_2)
    assert second.read_bytes() == OCI_MODULE_2
    assert first.exists()  # the old one stays until it expires
    assert harness.sample("wasm_cache_entries") == 2


async def test_pull_always_same_resource_version(harness: Harness) -> None:
    cache = await harness.cache()
    first = await pull(cache, "123456")
    assert await pull(cache, "123456", ALWAYS) == first
    assert len(harness.oci.prepared) == 1


async def test_pull_always_is_per_resource(harness: Harness) -> None:
    """Two plugins on one image: each resource's version is its own."""
    cache = await harness.cache()
    await pull(cache, "1", resource="ns.a")
    await pull(cache, "1", ALWAYS, resource="ns.b")
    assert len(harness.oci.prepared) == 2  # ns.b never recorded a version
    await pull(cache, "1", ALWAYS, resource="ns.a")
    await pull(cache, "1", ALWAYS, resource="ns.b")
    assert len(harness.oci.prepared) == 2


async def test_if_not_present_ignores_resource_version(harness: Harness) -> None:
    cache = await harness.cache()
    await pull(cache, "123456")
    await pull(cache, "0", IF_NOT_PRESENT)
    assert len(harness.oci.prepared) == 1


async def test_pull_always_with_checksum_uses_the_cache(harness: Harness) -> None:
    cache = await harness.cache()
    await pull(cache, "1")
    await pull(cache, "2", ALWAYS, checksum=DIGEST)
    assert len(harness.oci.prepared) == 1


@pytest.mark.parametrize("url", [LATEST, UNTAGGED], ids=["latest", "untagged"])
async def test_latest_tag_pulls_on_new_resource_version(harness: Harness, url: str) -> None:
    """Unspecified policy: ``latest`` behaves as Always; so does an untagged image (its tag is
    ``latest``; Istio only looks for a literal ``:latest`` suffix)."""
    cache = await harness.cache()
    await pull(cache, "1", url=url)
    await pull(cache, "2", url=url)
    assert len(harness.oci.prepared) == 2
    await pull(cache, "2", url=url)
    assert len(harness.oci.prepared) == 2


async def test_latest_tag_with_checksum_or_if_not_present(harness: Harness) -> None:
    cache = await harness.cache()
    await pull(cache, "1", url=LATEST)
    await pull(cache, "2", url=LATEST, checksum=DIGEST)
    await pull(cache, "3", IF_NOT_PRESENT, url=LATEST)
    assert len(harness.oci.prepared) == 1


async def test_fetch_oci_with_wrong_digest(harness: Harness) -> None:
    cache = await harness.cache()
    with pytest.raises(FetchError) as caught:
        await cache.get(TAGGED, opts(checksum="wrongdigest"))
    assert str(caught.value).startswith(
        f"module downloaded from {TAGGED} has checksum {DIGEST}, which does not match:"
    )
    assert caught.value.reason == metrics.CHECKSUM_MISMATCH
    assert harness.oci.fetched == []  # the manifest decided it: no blob


INDEX_DIGEST = hashlib.sha256(b"index v1").hexdigest()
MULTI = f"oci://{REGISTRY}/test/multi:v1"


@pytest.mark.parametrize("pinned", ["url", "checksum"])
async def test_an_index_digest_pins_its_image(harness: Harness, pinned: str) -> None:
    """An image index (multi-platform) pinned by its digest, in the URL or as the checksum, is the
    image it lists: accepted (Istio compares with the chosen image's digest and calls it a mismatch),
    and found again by that same digest without asking the registry."""
    harness.oci.images[MULTI.removeprefix("oci://")] = FakeImage(DIGEST, OCI_MODULE, INDEX_DIGEST)
    cache = await harness.cache()
    url, options = (
        (f"oci://{REGISTRY}/test/multi@sha256:{INDEX_DIGEST}", opts())
        if pinned == "url"
        else (MULTI, opts(checksum=INDEX_DIGEST))
    )
    path = await cache.get(url, options)
    assert path.read_bytes() == OCI_MODULE
    assert await cache.get(url, options) == path
    assert len(harness.oci.prepared) == 1


async def test_an_index_digest_does_not_pass_for_another(harness: Harness) -> None:
    harness.oci.images[MULTI.removeprefix("oci://")] = FakeImage(DIGEST, OCI_MODULE, INDEX_DIGEST)
    cache = await harness.cache()
    with pytest.raises(FetchError) as caught:
        await cache.get(MULTI, opts(checksum=DIGEST_2))
    assert caught.value.reason == metrics.CHECKSUM_MISMATCH
    assert await cache.get(MULTI, opts(checksum=DIGEST)) == expected_path(harness, MULTI, DIGEST)


async def test_oci_manifest_failure(harness: Harness) -> None:
    cache = await harness.cache()
    harness.oci.manifest_error = True
    with pytest.raises(FetchError, match="manifest") as caught:
        await cache.get(TAGGED, opts())
    assert caught.value.reason == metrics.MANIFEST_FAILURE
    assert harness.sample("wasm_remote_fetch_count", result="manifest_failure") == 1


async def test_oci_blob_failure(harness: Harness) -> None:
    cache = await harness.cache()
    harness.oci.blob_error = True
    with pytest.raises(FetchError) as caught:
        await cache.get(TAGGED, opts())
    assert caught.value.reason == metrics.DOWNLOAD_FAILURE
    assert harness.sample("wasm_remote_fetch_count", result="download_failure") == 1
    assert harness.files() == []


async def test_oci_timeout(harness: Harness) -> None:
    cache = await harness.cache()
    harness.oci.hang = True
    with pytest.raises(FetchError, match="timed out") as caught:
        await cache.get(TAGGED, opts(timeout=0.05))
    assert caught.value.reason == metrics.MANIFEST_FAILURE


async def test_oci_fetcher_options(harness: Harness) -> None:
    cache = await harness.cache(insecure_registries=frozenset({REGISTRY}), max_binary_bytes=1234)
    await cache.get(TAGGED, opts(pull_secret=b'{"auths": {}}'))
    assert harness.oci.fetchers == [{"insecure": True, "pull_secret": b'{"auths": {}}', "max_bytes": 1234}]


async def test_failed_repull_is_retried_at_the_same_version(harness: Harness) -> None:
    """Istio records a new resource version before fetching, so after a failed pull the same version
    is served the old module; here the version is recorded only once the pull succeeded."""
    cache = await harness.cache()
    await cache.get(TAGGED, opts(resource_name="ns.res", resource_version="1"))
    harness.oci.manifest_error = True
    always = PullPolicy.ALWAYS
    with pytest.raises(FetchError):
        await cache.get(TAGGED, opts(resource_name="ns.res", resource_version="2", pull_policy=always))
    harness.oci.manifest_error = False
    await cache.get(TAGGED, opts(resource_name="ns.res", resource_version="2", pull_policy=always))
    assert len(harness.oci.prepared) == 3


# --- what Istio does not do ---


async def test_concurrent_gets_fetch_once(harness: Harness, server: Server) -> None:
    cache = await harness.cache()
    url = server.url + "/slow"
    gets = [cache.get(url, opts()), cache.get(url, opts()), cache.get(url, opts(checksum=sha(MODULE)))]
    tasks = [asyncio.create_task(get) for get in gets]
    await server.asked(2)
    server.gate.set()
    paths = await asyncio.gather(*tasks)
    assert server.requests == ["/slow", "/slow"]  # one per (url, checksum) asked
    assert len(set(paths)) == 1


async def test_concurrent_gets_fetch_once_same_options(harness: Harness, server: Server) -> None:
    cache = await harness.cache()
    url = server.url + "/slow"
    tasks = [asyncio.create_task(cache.get(url, opts())) for _ in range(5)]
    await server.asked()
    await asyncio.sleep(0.05)  # time for a second request, were there one
    server.gate.set()
    paths = await asyncio.gather(*tasks)
    assert server.requests == ["/slow"]
    assert len(set(paths)) == 1
    assert harness.sample("wasm_remote_fetch_count", result="success") == 1


async def test_a_cancelled_waiter_does_not_cancel_the_fetch(harness: Harness, server: Server) -> None:
    cache = await harness.cache()
    url = server.url + "/slow"
    first = asyncio.create_task(cache.get(url, opts()))
    await server.asked()
    second = asyncio.create_task(cache.get(url, opts()))
    await asyncio.sleep(0.01)
    first.cancel()
    await asyncio.sleep(0.01)
    server.gate.set()
    path = await second
    assert first.cancelled()
    assert path.read_bytes() == MODULE
    assert server.requests == ["/slow"]


async def test_restart_with_a_warm_cache_does_not_fetch(harness: Harness, server: Server) -> None:
    cache = await harness.cache()
    http_path = await cache.get(server.url, opts(resource_name="ns.a", resource_version="1"))
    oci_path = await cache.get(TAGGED, opts(resource_name="ns.b", resource_version="1"))
    await cache.stop()
    harness.caches.remove(cache)

    restarted = await harness.cache()
    assert harness.sample("wasm_cache_entries") == 2
    assert await restarted.get(server.url, opts(resource_name="ns.a", resource_version="1")) == http_path
    assert await restarted.get(server.url, opts(checksum=sha(MODULE))) == http_path
    assert await restarted.get(TAGGED, opts(resource_name="ns.b", resource_version="1")) == oci_path
    assert await restarted.get(BY_DIGEST, opts()) == oci_path
    assert server.requests == ["/"]
    assert len(harness.oci.prepared) == 1
    # Always with the version seen before the restart: still no pull.
    always = opts(resource_name="ns.b", resource_version="1", pull_policy=PullPolicy.ALWAYS)
    assert await restarted.get(TAGGED, always) == oci_path
    assert len(harness.oci.prepared) == 1


async def test_restart_without_the_index_still_finds_modules_by_checksum(
    harness: Harness, server: Server
) -> None:
    """The URL index lost (or corrupt): lookups by checksum or digest still hit; by URL alone they
    fetch again (for OCI only the manifest, whose digest then finds the module)."""
    cache = await harness.cache()
    http_path = await cache.get(server.url, opts())
    await cache.get(TAGGED, opts())
    await cache.stop()
    harness.caches.remove(cache)
    for index in (harness.tmp / "data").glob("*.json"):
        index.write_text("{not json")

    restarted = await harness.cache()
    assert await restarted.get(server.url, opts(checksum=sha(MODULE))) == http_path
    assert server.requests == ["/"]
    await restarted.get(TAGGED, opts())
    assert len(harness.oci.prepared) == 2 and len(harness.oci.fetched) == 1


async def test_restart_purges_by_last_use_on_disk(harness: Harness, server: Server) -> None:
    cache = await harness.cache()
    path = await cache.get(server.url, opts())
    await cache.stop()
    harness.caches.remove(cache)
    old = time.time() - 3600
    os.utime(path, (old, old))
    await harness.cache(module_expiry=timedelta(minutes=30), purge_interval=timedelta(milliseconds=10))
    for _ in range(300):
        if not path.exists():
            break
        await asyncio.sleep(0.01)
    assert not path.exists()


async def test_restart_removes_leftover_temporary_files(harness: Harness, server: Server) -> None:
    cache = await harness.cache()
    path = await cache.get(server.url, opts())
    await cache.stop()
    harness.caches.remove(cache)
    leftover = path.with_name(f".{path.name}.0123456789ab.tmp")
    leftover.write_bytes(b"partial")
    await harness.cache()
    assert not leftover.exists()
    assert path.exists()


async def test_a_module_file_removed_behind_the_cache_is_fetched_again(
    harness: Harness, server: Server
) -> None:
    cache = await harness.cache()
    path = await cache.get(server.url, opts(checksum=sha(MODULE)))
    path.unlink()
    assert await cache.get(server.url, opts(checksum=sha(MODULE))) == path
    assert path.read_bytes() == MODULE
    assert server.requests == ["/", "/"]


async def test_unwritable_cache_directory(harness: Harness, server: Server) -> None:
    blocker = harness.tmp / "not-a-dir"
    blocker.write_text("")
    cache = await harness.cache(cache_dir=blocker / "data")
    with pytest.raises(FetchError, match=f"{blocker / 'data'}"):
        await cache.get(server.url, opts())


async def test_stop_cancels_fetches_in_flight(harness: Harness, server: Server) -> None:
    cache = await harness.cache()
    task = asyncio.create_task(cache.get(server.url + "/slow", opts()))
    await server.asked()
    await cache.stop()
    harness.caches.remove(cache)
    with pytest.raises(FetchError, match="stopped"):  # not a CancelledError: the caller was not cancelled
        await task


# --- with the real image fetcher and a real registry ---


async def test_oci_through_a_real_registry_and_a_restart_without_it(tmp_path: Path) -> None:
    """The default image fetcher pulls from Debian's docker-registry; after a restart the module is
    served from disk with the registry gone."""
    from tests.wasm.registry import OCI, push_wasm, running_registry

    with running_registry() as registry:
        settings = WasmSettings(cache_dir=tmp_path / "data", insecure_registries=frozenset({registry.host}))
        digest = push_wasm(registry, "cache/real", "v1", OCI_MODULE, OCI)
        url = f"oci://{registry.reference('cache/real', 'v1')}"
        cache = ModuleCache(settings, WasmMetrics(Registry()))
        await cache.start()
        try:
            path = await cache.get(url, opts(resource_name="ns.res", resource_version="1"))
            assert path.name == f"{digest}.wasm"
            assert path.read_bytes() == OCI_MODULE
            with pytest.raises(FetchError) as caught:
                await cache.get(f"oci://{registry.reference('cache/real', 'missing')}", opts())
            assert caught.value.reason == metrics.MANIFEST_FAILURE
        finally:
            await cache.stop()
    restarted = ModuleCache(settings, WasmMetrics(Registry()))
    await restarted.start()
    try:
        assert await restarted.get(url, opts(resource_name="ns.res", resource_version="1")) == path
        pinned = f"{url.rpartition(':')[0]}@sha256:{digest}"
        assert await restarted.get(pinned, opts()) == path
    finally:
        await restarted.stop()
