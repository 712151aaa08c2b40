"""The OCI image fetcher against a real registry (Debian's docker-registry), and its pull-secret reading.

Cases after Istio's ``pkg/wasm/imagefetcher_test.go`` (1.28.10 and HEAD): the three image formats,
tag and digest references, pull secrets, the bearer realm guard, an image of no Wasm format.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import socket
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from istio_agent.config.wasm import WasmSettings
from istio_agent.metrics import Registry as MetricsRegistry
from istio_agent.wasm import metrics
from istio_agent.wasm.cache import ModuleCache
from istio_agent.wasm.dockerconfig import ANONYMOUS, Credentials, credentials_for, default_credentials
from istio_agent.wasm.errors import FetchError
from istio_agent.wasm.metrics import WasmMetrics
from istio_agent.wasm.oci import ImageFetcher, Reference, plain_http_fallback
from istio_agent.wasm.ociauth import parse_challenges
from istio_agent.wasm.ocilayers import OCI_MANIFEST, extract_plugin, wasm_layer
from istio_agent.wasm.options import GetOptions
from istio_agent.wasm.ssrf import DialGuard
from tests.aiohttp_apps import serve_app
from tests.http.h2server import tls_server_context
from tests.wasm.registry import (
    ARTIFACT,
    DOCKER,
    FORMATS,
    OCI,
    Registry,
    docker_config,
    push_image,
    push_index,
    push_wasm,
    realm_host,
    running_registry,
    sha256,
    tar_gz,
)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


# --- pull secrets (docker config JSON) ---


def test_pull_secret_auth_for_the_registry() -> None:
    config = json.dumps({"auths": {"test.io": {"auth": b64("foo:bar")}}}).encode()
    assert credentials_for(config, "test.io") == Credentials("foo", "bar")


def test_pull_secret_username_and_password_fields() -> None:
    config = json.dumps({"auths": {"reg:5000": {"username": "u", "password": "p"}}}).encode()
    assert credentials_for(config, "reg:5000") == Credentials("u", "p")


def test_pull_secret_auth_wins_over_username_and_password() -> None:
    entry = {"auth": b64("a:b:c"), "username": "u", "password": "p"}
    config = json.dumps({"auths": {"reg": entry}}).encode()
    assert credentials_for(config, "reg") == Credentials("a", "b:c")


@pytest.mark.parametrize(
    "key", ["https://reg.example:5000", "http://reg.example:5000/v1/", "reg.example:5000/v2"]
)
def test_pull_secret_key_with_scheme_or_path_matches_the_host(key: str) -> None:
    config = json.dumps({"auths": {key: {"auth": b64("u:p")}}}).encode()
    assert credentials_for(config, "reg.example:5000") == Credentials("u", "p")


def test_pull_secret_exact_key_wins_over_a_legacy_one() -> None:
    auths = {"https://reg.example": {"auth": b64("old:x")}, "reg.example": {"auth": b64("new:y")}}
    assert credentials_for(json.dumps({"auths": auths}).encode(), "reg.example") == Credentials("new", "y")


def test_pull_secret_docker_hub_key() -> None:
    config = json.dumps({"auths": {"https://index.docker.io/v1/": {"auth": b64("u:p")}}}).encode()
    assert credentials_for(config, "index.docker.io") == Credentials("u", "p")


def test_pull_secret_without_the_registry_is_anonymous() -> None:
    config = json.dumps({"auths": {"other.io": {"auth": b64("u:p")}}}).encode()
    assert credentials_for(config, "test.io") is ANONYMOUS
    assert credentials_for(b"{}", "test.io") is ANONYMOUS


def test_pull_secret_credential_helpers_are_not_run() -> None:
    config = json.dumps({"credsStore": "evil", "credHelpers": {"test.io": "evil"}}).encode()
    assert credentials_for(config, "test.io") is ANONYMOUS


@pytest.mark.parametrize(
    "config",
    [b"null", b"not json", b"[]", b'{"auths": []}', b'{"auths": {"test.io": "x"}}'],
)
def test_pull_secret_that_is_no_docker_config_is_an_error(config: bytes) -> None:
    with pytest.raises(FetchError):
        credentials_for(config, "test.io")


def test_pull_secret_bad_auth_is_an_error_without_the_secret() -> None:
    config = json.dumps({"auths": {"test.io": {"auth": b64("no-colon-secret")}}}).encode()
    with pytest.raises(FetchError) as caught:
        credentials_for(config, "test.io")
    assert "no-colon-secret" not in str(caught.value)
    assert "not base64 of user:password" in str(caught.value)


def test_credentials_repr_hides_the_password() -> None:
    assert "hunter2" not in repr(Credentials("u", "hunter2"))


def test_default_credentials_from_docker_config_dir(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"auths": {"reg": {"auth": b64("u:p")}}}))
    assert default_credentials("reg", {"DOCKER_CONFIG": str(tmp_path)}) == Credentials("u", "p")
    assert default_credentials("reg", {"HOME": str(tmp_path / "nobody")}) is ANONYMOUS


# --- references ---


@pytest.mark.parametrize(
    ("text", "registry", "repository", "tag", "digest"),
    [
        ("reg.example/wasm/filter:v1", "reg.example", "wasm/filter", "v1", None),
        ("127.0.0.1:5000/a/b/c", "127.0.0.1:5000", "a/b/c", "latest", None),
        (f"reg.example/f@sha256:{'a' * 64}", "reg.example", "f", None, f"sha256:{'a' * 64}"),
        (f"reg.example/f:v2@sha256:{'b' * 64}", "reg.example", "f", None, f"sha256:{'b' * 64}"),
        ("localhost:5000/f:1.0_rc-2", "localhost:5000", "f", "1.0_rc-2", None),
        ("docker.io/istio/f:v1", "index.docker.io", "istio/f", "v1", None),
        ("docker.io/f", "index.docker.io", "library/f", "latest", None),
        ("[::1]:5000/f:v1", "[::1]:5000", "f", "v1", None),
    ],
)
def test_reference_parsing(
    text: str, registry: str, repository: str, tag: str | None, digest: str | None
) -> None:
    reference = Reference.parse(text)
    assert (reference.registry, reference.repository, reference.tag, reference.digest) == (
        registry,
        repository,
        tag,
        digest,
    )


@pytest.mark.parametrize(
    "text",
    [
        "filter",  # no registry: Istio's oci:// URLs always name one
        "filter:v1",
        "reg.example/",
        "reg.example/Upper/case",
        "reg.example/f:",
        "reg.example/f:-bad",
        "reg.example/f@sha256:abc",
        f"reg.example/f@md5:{'a' * 32}",
        "reg.example/a//b",
        "reg ex/f",
        "reg.example/f?x=1",
    ],
)
def test_invalid_references_are_manifest_failures(text: str) -> None:
    with pytest.raises(FetchError) as caught:
        Reference.parse(text)
    assert caught.value.reason == metrics.MANIFEST_FAILURE


# --- Wasm layer extraction ---


def test_plugin_wasm_is_found_under_a_directory() -> None:
    blob = tar_gz({"README": b"x", "./dir/plugin.wasm": MODULE})
    assert extract_plugin(blob, 1024) == MODULE


def test_archive_without_plugin_wasm() -> None:
    with pytest.raises(FetchError, match=r"plugin\.wasm not found"):
        extract_plugin(tar_gz({"other.wasm": MODULE}), 1024)


def test_plugin_wasm_over_the_limit_is_refused_not_truncated() -> None:
    with pytest.raises(FetchError, match="limit of 100 bytes"):
        extract_plugin(tar_gz({"plugin.wasm": MODULE + bytes(200)}), 100)


def test_a_gzip_bomb_is_not_inflated_past_the_limit() -> None:
    with pytest.raises(FetchError, match="limit of 4096 bytes"):
        extract_plugin(tar_gz({"filler": bytes(10_000_000), "plugin.wasm": MODULE}), 4096)


def test_a_layer_that_is_not_tar_gz() -> None:
    with pytest.raises(FetchError, match="not a gzip-compressed tar"):
        extract_plugin(b"plain bytes", 1024)


# --- pulls from a real registry ---

MODULE = b"\0asm\x01\0\0\0" + b"\x00" * 8  # a module header and an empty custom-section-ish tail
OPEN = DialGuard()


@pytest.fixture(scope="module")
def registry() -> Iterator[Registry]:
    with running_registry() as running:
        yield running


@pytest.fixture(scope="module")
def auth_registry() -> Iterator[Registry]:
    with running_registry(auth=("wasm-user", "s3cret-pass")) as running:
        yield running


@pytest.fixture(scope="module")
def tls_registry() -> Iterator[Registry]:
    with running_registry(tls=True) as running:
        yield running


def fetcher(
    *,
    insecure: bool = True,
    pull_secret: bytes | None = None,
    max_bytes: int = 1 << 20,
    guard: DialGuard = OPEN,
) -> ImageFetcher:
    return ImageFetcher(guard=guard, max_bytes=max_bytes, insecure=insecure, pull_secret=pull_secret)


@pytest.mark.parametrize("fmt", FORMATS)
async def test_each_format_is_pulled_by_tag(registry: Registry, fmt: str) -> None:
    module = MODULE + fmt.encode()
    digest = push_wasm(registry, f"formats/{fmt}", "v1", module, fmt)
    prepared = await fetcher().prepare(registry.reference(f"formats/{fmt}", "v1"))
    assert prepared.digest == digest
    assert await prepared.fetch() == module


async def test_default_tag_is_latest(registry: Registry) -> None:
    digest = push_wasm(registry, "tags/default", "latest", MODULE, OCI)
    prepared = await fetcher().prepare(f"{registry.host}/tags/default")
    assert prepared.digest == digest


@pytest.mark.parametrize("fmt", FORMATS)
async def test_pulled_by_digest(registry: Registry, fmt: str) -> None:
    digest = push_wasm(registry, f"digests/{fmt}", "v1", MODULE, fmt)
    prepared = await fetcher().prepare(f"{registry.host}/digests/{fmt}@sha256:{digest}")
    assert prepared.digest == digest
    assert await prepared.fetch() == MODULE


async def test_unknown_digest_is_a_manifest_failure(registry: Registry) -> None:
    push_wasm(registry, "digests/unknown", "v1", MODULE, OCI)
    with pytest.raises(FetchError) as caught:
        await fetcher().prepare(f"{registry.host}/digests/unknown@sha256:{'0' * 64}")
    assert caught.value.reason == metrics.MANIFEST_FAILURE
    message = str(caught.value)
    assert registry.host in message and "digests/unknown" in message and "MANIFEST_UNKNOWN" in message


async def test_unknown_tag_is_a_manifest_failure(registry: Registry) -> None:
    with pytest.raises(FetchError) as caught:
        await fetcher().prepare(registry.reference("nothing/here", "v9"))
    assert caught.value.reason == metrics.MANIFEST_FAILURE


async def test_index_gives_the_linux_amd64_image(registry: Registry) -> None:
    amd64, arm64 = MODULE + b"amd64", MODULE + b"arm64"
    push_index(registry, "index/multi", "v1", {("linux", "arm64"): arm64, ("linux", "amd64"): amd64})
    prepared = await fetcher().prepare(registry.reference("index/multi", "v1"))
    assert await prepared.fetch() == amd64


async def test_index_with_one_image_of_another_platform_gives_it(registry: Registry) -> None:
    push_index(registry, "index/single", "v1", {("linux", "arm64"): MODULE})
    prepared = await fetcher().prepare(registry.reference("index/single", "v1"))
    assert await prepared.fetch() == MODULE


async def test_index_without_linux_amd64_among_several_is_a_manifest_failure(registry: Registry) -> None:
    push_index(registry, "index/none", "v1", {("linux", "arm64"): MODULE, ("linux", "s390x"): MODULE})
    with pytest.raises(FetchError, match="linux/amd64") as caught:
        await fetcher().prepare(registry.reference("index/none", "v1"))
    assert caught.value.reason == metrics.MANIFEST_FAILURE


async def test_image_of_no_wasm_format_is_a_manifest_failure(registry: Registry) -> None:
    # Not Istio's uncompressed-tar case: skopeo gzips an uncompressed tar layer on its way to a registry.
    layer = ("application/vnd.example.unknown", b"not a tar at all")
    push_image(registry, "formats/invalid", "v1", [layer])
    with pytest.raises(FetchError) as caught:
        await fetcher().prepare(registry.reference("formats/invalid", "v1"))
    assert caught.value.reason == metrics.MANIFEST_FAILURE
    message = str(caught.value)
    assert (
        "application/vnd.example.unknown" in message
        and "application/vnd.oci.image.layer.v1.tar+gzip" in message
    )
    assert "1 layers (expect 2)" in message


async def test_docker_image_without_plugin_wasm_is_a_download_failure(registry: Registry) -> None:
    layer = ("application/vnd.oci.image.layer.v1.tar+gzip", tar_gz({"other.wasm": MODULE}))
    push_image(registry, "formats/noplugin", "v1", [layer], docker=True)
    prepared = await fetcher().prepare(registry.reference("formats/noplugin", "v1"))
    with pytest.raises(FetchError, match=r"plugin\.wasm not found") as caught:
        await prepared.fetch()
    assert caught.value.reason == metrics.DOWNLOAD_FAILURE


async def test_oversized_raw_layer_is_refused(registry: Registry) -> None:
    push_wasm(registry, "size/artifact", "v1", MODULE + bytes(5000), ARTIFACT)
    prepared = await fetcher(max_bytes=1000).prepare(registry.reference("size/artifact", "v1"))
    with pytest.raises(FetchError, match="limit of 1000 bytes") as caught:
        await prepared.fetch()
    assert caught.value.reason == metrics.DOWNLOAD_FAILURE


async def test_oversized_module_in_a_small_layer_is_refused(registry: Registry) -> None:
    push_wasm(registry, "size/compat", "v1", MODULE + bytes(50_000), OCI)  # compresses to ~100 bytes
    prepared = await fetcher(max_bytes=10_000).prepare(registry.reference("size/compat", "v1"))
    with pytest.raises(FetchError, match="limit of 10000 bytes") as caught:
        await prepared.fetch()
    assert caught.value.reason == metrics.DOWNLOAD_FAILURE


async def test_registry_that_is_down() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(FetchError) as caught:
        await fetcher(insecure=False).prepare(f"127.0.0.1:{port}/down/f:v1")
    assert caught.value.reason == metrics.MANIFEST_FAILURE
    assert f"127.0.0.1:{port}" in str(caught.value)
    assert "Connection refused" in str(caught.value)
    assert f"http://127.0.0.1:{port}/v2/" in str(caught.value)  # loopback: plain http tried too
    assert "WASM_INSECURE_REGISTRIES" not in str(caught.value)  # no hint where it would mislead


async def test_every_connection_goes_through_the_guard(registry: Registry) -> None:
    guard = DialGuard((ipaddress.ip_network("127.0.0.0/8"),))
    with pytest.raises(FetchError, match="blocked") as caught:
        await fetcher(guard=guard).prepare(registry.reference("formats/oci", "v1"))
    assert caught.value.reason == metrics.MANIFEST_FAILURE


# --- TLS and plain HTTP ---


@pytest.mark.parametrize(
    ("registry", "falls_back"),
    [
        ("localhost:5000", True),
        ("localhost", True),  # go-containerregistry: only with a port; loopback all the same
        ("wasm.localhost:5000", True),
        ("127.0.0.1", True),
        ("127.0.0.1:5000", True),
        ("127.1.2.3:5000", True),  # go-containerregistry: 127.0.0.1 only; all of 127/8 is loopback
        ("[::1]:5000", True),
        ("10.0.0.5:5000", True),
        ("172.16.0.1", True),
        ("172.31.255.255:443", True),
        ("192.168.1.1:5000", True),
        ("172.32.0.1:5000", False),
        ("11.0.0.1:5000", False),
        ("100.64.0.1:5000", False),
        ("[fd00::1]:5000", False),  # ULA: not RFC 1918, as go-containerregistry
        ("registry.example.com", False),
        ("10.0.0.5.example.com:5000", False),
        ("localhost.example.com:5000", False),
        ("localhostx:5000", False),
    ],
)
def test_which_registries_fall_back_to_plain_http(registry: str, falls_back: bool) -> None:
    """go-containerregistry's ``name.Registry.Scheme()``: "http" for localhost, loopback, RFC 1918."""
    assert plain_http_fallback(registry) is falls_back


async def test_plain_http_registry_on_loopback_pulls_without_insecure(registry: Registry) -> None:
    """As Istio (go-containerregistry's ping tries https, then plain http for such hosts): a
    plain-HTTP registry at a loopback (or RFC 1918) address needs no WASM_INSECURE_REGISTRIES."""
    push_wasm(registry, "insecure/plain", "v1", MODULE, OCI)
    for insecure in (False, True):
        prepared = await fetcher(insecure=insecure).prepare(registry.reference("insecure/plain", "v1"))
        assert await prepared.fetch() == MODULE


@pytest.fixture
async def public_name(monkeypatch: pytest.MonkeyPatch) -> str:
    """``registry.example.com``, resolving to 127.0.0.1 (the resolver's answer fixed, the sockets real)."""
    name = "registry.example.com"
    loop = asyncio.get_running_loop()
    resolve = loop.getaddrinfo

    async def fixed(host: str, port: int, **options: Any) -> list[Any]:
        return await resolve("127.0.0.1" if host == name else host, port, **options)

    monkeypatch.setattr(loop, "getaddrinfo", fixed)
    return name


async def test_a_public_registry_is_never_tried_over_plain_http(stand_in: StandIn, public_name: str) -> None:
    """A name that is not localhost, loopback or RFC 1918 (whatever it resolves to): https only,
    unless WASM_INSECURE_REGISTRIES lists it."""
    reference = f"{public_name}:{stand_in.port}/public/f:v1"
    with pytest.raises(FetchError) as caught:
        await fetcher(insecure=False).prepare(reference)
    assert caught.value.reason == metrics.MANIFEST_FAILURE
    message = str(caught.value)
    assert f"https://{public_name}:{stand_in.port}/v2/" in message
    assert "http://" not in message.replace("https://", "")
    assert "WASM_INSECURE_REGISTRIES" in message and "RFC 1918" in message
    assert stand_in.requests == []  # the plain-HTTP stand-in never saw a request
    prepared = await fetcher(insecure=True).prepare(reference)
    assert await prepared.fetch() == MODULE


async def test_a_private_registry_over_https_is_verified(tls_registry: Registry) -> None:
    """The https attempt keeps verifying the certificate; falling back to plain http does not help a
    registry that speaks TLS only, and the error says what would."""
    push_wasm(tls_registry, "private/tls", "v1", MODULE, DOCKER)
    with pytest.raises(FetchError) as caught:
        await fetcher(insecure=False).prepare(tls_registry.reference("private/tls", "v1"))
    message = str(caught.value)
    assert "certificate verify failed" in message
    assert f"http://{tls_registry.host}/v2/" in message  # the plain-HTTP attempt, reported too
    assert "WASM_INSECURE_REGISTRIES" in message


async def test_self_signed_registry_needs_insecure(tls_registry: Registry) -> None:
    push_wasm(tls_registry, "insecure/tls", "v1", MODULE, DOCKER)
    with pytest.raises(FetchError, match="certificate") as caught:
        await fetcher(insecure=False).prepare(tls_registry.reference("insecure/tls", "v1"))
    assert caught.value.reason == metrics.MANIFEST_FAILURE
    prepared = await fetcher(insecure=True).prepare(tls_registry.reference("insecure/tls", "v1"))
    assert await prepared.fetch() == MODULE


# --- Basic auth (htpasswd) ---


async def test_auth_with_the_right_pull_secret(auth_registry: Registry) -> None:
    digest = push_wasm(auth_registry, "auth/f", "v1", MODULE, ARTIFACT)
    prepared = await fetcher(pull_secret=auth_registry.pull_secret()).prepare(
        auth_registry.reference("auth/f", "v1")
    )
    assert prepared.digest == digest
    assert await prepared.fetch() == MODULE


async def manifest_failure(registry: Registry, repo: str, fmt: str, pull_secret: bytes | None = None) -> str:
    """Push the module as ``repo:v1`` and pull it, expecting a ``manifest_failure``; its message."""
    push_wasm(registry, repo, "v1", MODULE, fmt)
    with pytest.raises(FetchError) as caught:
        await fetcher(pull_secret=pull_secret).prepare(registry.reference(repo, "v1"))
    assert caught.value.reason == metrics.MANIFEST_FAILURE
    return str(caught.value)


async def test_auth_with_the_wrong_pull_secret(auth_registry: Registry) -> None:
    secret = auth_registry.pull_secret("wasm-user", "wrong-password")
    message = await manifest_failure(auth_registry, "auth/f", ARTIFACT, secret)
    assert "401" in message and "auth/f" in message
    assert "wrong-password" not in message


async def test_auth_without_a_pull_secret(auth_registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_CONFIG", "/nonexistent")
    assert "401" in await manifest_failure(auth_registry, "auth/f", ARTIFACT)


async def test_pull_secret_for_another_registry_is_anonymous(auth_registry: Registry) -> None:
    secret = docker_config("other.example", "wasm-user", "s3cret-pass")
    with pytest.raises(FetchError, match="401"):
        await fetcher(pull_secret=secret).prepare(auth_registry.reference("auth/f", "v1"))


# --- a stand-in registry (aiohttp) for what a real one will not do: bad digests, redirects, tokens ---


class StandIn:
    """A registry stand-in serving one artifact image of ``module`` at ``repo:v1``, optionally behind
    a Bearer token from its own ``/token`` realm; it records the requests it gets."""

    def __init__(self, module: bytes, *, realm_host: str | None = None, token_key: str = "token") -> None:
        self.module = module
        self.realm_host = realm_host
        self.realm_port = 0
        self.realm_scheme = "http"
        self.runner: web.AppRunner | None = None
        self.token_key = token_key
        self.requests: list[web.Request] = []
        self.token_requests: list[web.Request] = []
        self.token_forms: list[dict[str, str]] = []
        self.blob_override: bytes | None = None
        self.manifest_override: bytes | None = None
        self.blob_redirect: str | None = None
        self.port = 0
        self.layer = {
            "mediaType": "application/vnd.module.wasm.content.layer.v1+wasm",
            "digest": f"sha256:{sha256(module)}",
            "size": len(module),
        }
        config = {
            "mediaType": "application/vnd.module.wasm.config.v1+json",
            "digest": f"sha256:{sha256(b'{}')}",
            "size": 2,
        }
        other = {
            "mediaType": "application/vnd.module.wasm.config.v1+json",
            "digest": config["digest"],
            "size": 2,
        }
        self.manifest = json.dumps(
            {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": config, "layers": [self.layer, other]}
        ).encode()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v2/", self.ping)
        app.router.add_get("/v2/{repo:.+}/manifests/{ref}", self.get_manifest)
        app.router.add_get("/v2/{repo:.+}/blobs/{digest}", self.get_blob)
        app.router.add_get("/token", self.token)
        app.router.add_post("/token", self.token)
        return app

    def _authorized(self, request: web.Request) -> web.Response | None:
        self.requests.append(request)
        if self.realm_host is None or request.headers.get("Authorization") == "Bearer t0ken":
            return None
        realm = f"{self.realm_scheme}://{self.realm_host}:{self.realm_port or self.port}/token"
        challenge = f'Bearer realm="{realm}",service="stand-in",scope="repository:bearer/f:pull"'
        return web.json_response(
            {"errors": [{"code": "UNAUTHORIZED"}]}, status=401, headers={"WWW-Authenticate": challenge}
        )

    async def serve_realm(self, tls: ssl.SSLContext | None = None) -> None:
        """Answer on this machine's host name too, and name it as the realm (see ``realm_host``)."""
        assert self.runner is not None
        host = realm_host()
        site = web.TCPSite(self.runner, host.address, 0, ssl_context=tls)
        await site.start()
        self.realm_host, self.realm_port = host.name, int(self.runner.addresses[-1][1])
        self.realm_scheme = "https" if tls else "http"

    async def ping(self, request: web.Request) -> web.StreamResponse:
        return self._authorized(request) or web.json_response({})

    async def get_manifest(self, request: web.Request) -> web.StreamResponse:
        refused = self._authorized(request)
        if refused is not None:
            return refused
        body = self.manifest_override or self.manifest
        return web.Response(body=body, content_type=OCI_MANIFEST)

    async def get_blob(self, request: web.Request) -> web.StreamResponse:
        refused = self._authorized(request)
        if refused is not None:
            return refused
        if self.blob_redirect is not None:
            raise web.HTTPTemporaryRedirect(self.blob_redirect)
        return web.Response(body=self.blob_override or self.module, content_type="application/octet-stream")

    async def token(self, request: web.Request) -> web.StreamResponse:
        self.token_requests.append(request)
        if request.method == "POST":
            self.token_forms.append({k: str(v) for k, v in (await request.post()).items()})
            return web.json_response({"access_token": "t0ken", "refresh_token": "refresh-me"})
        return web.json_response({self.token_key: "t0ken"})


@pytest.fixture
async def stand_in() -> AsyncIterator[StandIn]:
    server = StandIn(MODULE)
    runner, server.port = await serve_app(server.app())
    server.runner = runner
    try:
        yield server
    finally:
        await runner.cleanup()


async def test_manifest_whose_digest_is_not_the_referenced_one(stand_in: StandIn) -> None:
    wanted = sha256(stand_in.manifest)
    stand_in.manifest_override = stand_in.manifest + b" "  # same JSON, other bytes, other digest
    with pytest.raises(FetchError, match="digest") as caught:
        await fetcher().prepare(f"127.0.0.1:{stand_in.port}/digest/f@sha256:{wanted}")
    assert caught.value.reason == metrics.MANIFEST_FAILURE


async def test_blob_whose_digest_is_not_the_layers(stand_in: StandIn) -> None:
    stand_in.blob_override = MODULE[:-1] + b"X"
    prepared = await fetcher().prepare(f"127.0.0.1:{stand_in.port}/digest/f:v1")
    with pytest.raises(FetchError, match="digest") as caught:
        await prepared.fetch()
    assert caught.value.reason == metrics.DOWNLOAD_FAILURE


async def test_blob_redirect_to_storage_gets_no_authorization(stand_in: StandIn) -> None:
    storage_requests: list[web.Request] = []

    async def storage(request: web.Request) -> web.Response:
        storage_requests.append(request)
        return web.Response(body=MODULE)

    app = web.Application()
    app.router.add_get("/blob", storage)
    runner, port = await serve_app(app)
    try:
        stand_in.blob_redirect = f"http://127.0.0.1:{port}/blob"
        secret = docker_config(f"127.0.0.1:{stand_in.port}", "u", "p")
        stand_in.realm_host = None
        prepared = await fetcher(pull_secret=secret).prepare(f"127.0.0.1:{stand_in.port}/redirect/f:v1")
        assert await prepared.fetch() == MODULE
    finally:
        await runner.cleanup()
    assert len(storage_requests) == 1
    assert "Authorization" not in storage_requests[0].headers


@pytest.fixture
async def tls_stand_in(tmp_path: Path) -> AsyncIterator[tuple[StandIn, ssl.SSLContext]]:
    """The stand-in over TLS with a certificate nobody trusts (an insecure registry's)."""
    server = StandIn(MODULE)
    tls = tls_server_context(tmp_path, None)
    server.runner = web.AppRunner(server.app())
    await server.runner.setup()
    await web.TCPSite(server.runner, "127.0.0.1", 0, ssl_context=tls).start()
    server.port = int(server.runner.addresses[0][1])
    try:
        yield server, tls
    finally:
        await server.runner.cleanup()


async def test_blob_redirect_from_https_to_plain_http_is_refused(
    tls_stand_in: tuple[StandIn, ssl.SSLContext],
) -> None:
    server, _ = tls_stand_in
    server.blob_redirect = f"http://127.0.0.1:{server.port}/v2/plain/blob"
    prepared = await fetcher(insecure=True).prepare(f"127.0.0.1:{server.port}/redirect/f:v1")
    with pytest.raises(FetchError, match="plain http") as caught:
        await prepared.fetch()
    assert caught.value.reason == metrics.DOWNLOAD_FAILURE


async def test_insecure_registry_does_not_make_its_realm_unverified(
    tls_stand_in: tuple[StandIn, ssl.SSLContext],
) -> None:
    server, tls = tls_stand_in
    await server.serve_realm(tls)  # another host: WASM_INSECURE_REGISTRIES names the registry only
    with pytest.raises(FetchError, match="certificate verify failed") as caught:
        await fetcher(insecure=True).prepare(f"127.0.0.1:{server.port}/bearer/f:v1")
    assert caught.value.reason == metrics.MANIFEST_FAILURE
    assert server.token_requests == []


async def test_blob_redirect_to_a_blocked_address_is_refused(stand_in: StandIn) -> None:
    stand_in.blob_redirect = "http://169.254.169.254/latest/meta-data/"
    prepared = await fetcher().prepare(f"127.0.0.1:{stand_in.port}/redirect/f:v1")
    with pytest.raises(FetchError, match="link-local") as caught:
        await prepared.fetch()
    assert caught.value.reason == metrics.DOWNLOAD_FAILURE


async def test_bearer_realm_at_a_forbidden_address_is_never_requested(stand_in: StandIn) -> None:
    stand_in.realm_host = "127.0.0.1"
    with pytest.raises(FetchError, match="rejected unsafe bearer realm") as caught:
        await fetcher().prepare(f"127.0.0.1:{stand_in.port}/bearer/f:v1")
    assert caught.value.reason == metrics.MANIFEST_FAILURE
    assert stand_in.token_requests == []


@pytest.mark.parametrize("token_key", ["token", "access_token"])
async def test_bearer_token_flow_with_the_pull_secret(stand_in: StandIn, token_key: str) -> None:
    await stand_in.serve_realm()
    stand_in.token_key = token_key
    secret = docker_config(f"127.0.0.1:{stand_in.port}", "wasm-user", "pw")
    prepared = await fetcher(pull_secret=secret).prepare(f"127.0.0.1:{stand_in.port}/bearer/f:v1")
    assert prepared.digest == sha256(stand_in.manifest)
    assert await prepared.fetch() == MODULE
    (token_request,) = stand_in.token_requests
    assert token_request.query["scope"] == "repository:bearer/f:pull"
    assert token_request.query["service"] == "stand-in"
    assert token_request.headers["Authorization"] == "Basic " + b64("wasm-user:pw")
    assert stand_in.requests[-1].headers["Authorization"] == "Bearer t0ken"


async def test_bearer_token_flow_anonymous(stand_in: StandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_CONFIG", "/nonexistent")
    await stand_in.serve_realm()
    prepared = await fetcher().prepare(f"127.0.0.1:{stand_in.port}/bearer/f:v1")
    assert await prepared.fetch() == MODULE
    assert "Authorization" not in stand_in.token_requests[0].headers


async def test_registry_token_in_the_pull_secret_is_sent_as_is(stand_in: StandIn) -> None:
    await stand_in.serve_realm()
    secret = json.dumps({"auths": {f"127.0.0.1:{stand_in.port}": {"registrytoken": "t0ken"}}}).encode()
    prepared = await fetcher(pull_secret=secret).prepare(f"127.0.0.1:{stand_in.port}/bearer/f:v1")
    assert await prepared.fetch() == MODULE
    assert stand_in.token_requests == []  # the secret's registrytoken is the token


# --- WWW-Authenticate ---


def test_challenges_parsed() -> None:
    value = 'Bearer realm="https://auth.example/token",service="reg, example", Basic realm="x\\"y"'
    assert parse_challenges(value) == [
        ("bearer", {"realm": "https://auth.example/token", "service": "reg, example"}),
        ("basic", {"realm": 'x"y'}),
    ]
    assert parse_challenges('Negotiate abc==, Basic charset="UTF-8"') == [
        ("negotiate", {}),
        ("basic", {"charset": "UTF-8"}),
    ]
    assert parse_challenges("Bearer realm=https://auth.example/t?x=1,service=reg") == [
        ("bearer", {"realm": "https://auth.example/t?x=1", "service": "reg"})
    ]


# --- Bearer auth against the real registry (distribution's token auth, our token server as its realm) ---


@pytest.fixture(scope="module")
def token_registry() -> Iterator[Registry]:
    with running_registry(auth=("wasm-user", "s3cret-pass"), token=True) as running:
        yield running


@pytest.fixture(scope="module")
def public_token_registry() -> Iterator[Registry]:
    with running_registry(auth=("wasm-user", "s3cret-pass"), token=True, anonymous_pull=True) as running:
        yield running


async def test_bearer_with_the_right_pull_secret(token_registry: Registry) -> None:
    assert token_registry.token_server is not None
    digest = push_wasm(token_registry, "bearer/real", "v1", MODULE, DOCKER)
    token_registry.token_server.requests.clear()
    prepared = await fetcher(pull_secret=token_registry.pull_secret()).prepare(
        token_registry.reference("bearer/real", "v1")
    )
    assert prepared.digest == digest
    assert await prepared.fetch() == MODULE
    (asked,) = token_registry.token_server.requests
    assert (asked.service, asked.scopes, asked.user) == (
        "wasm-tests-registry",
        ["repository:bearer/real:pull"],
        "wasm-user",
    )


async def test_bearer_with_the_wrong_pull_secret(token_registry: Registry) -> None:
    secret = token_registry.pull_secret("wasm-user", "not-the-password")
    message = await manifest_failure(token_registry, "bearer/real", DOCKER, secret)
    assert "token request" in message and "401" in message and "not-the-password" not in message


async def test_bearer_without_a_pull_secret(
    token_registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DOCKER_CONFIG", "/nonexistent")
    assert "401" in await manifest_failure(token_registry, "bearer/real", DOCKER)


async def test_bearer_anonymous_pull(
    public_token_registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DOCKER_CONFIG", "/nonexistent")
    push_wasm(public_token_registry, "bearer/public", "v1", MODULE, OCI)
    prepared = await fetcher().prepare(public_token_registry.reference("bearer/public", "v1"))
    assert await prepared.fetch() == MODULE
    assert public_token_registry.token_server is not None
    assert public_token_registry.token_server.requests[-1].user is None


async def test_index_by_its_digest(registry: Registry) -> None:
    amd64 = MODULE + b"amd64"
    index_digest = push_index(registry, "index/pinned", "v1", {("linux", "amd64"): amd64})
    prepared = await fetcher().prepare(f"{registry.host}/index/pinned@sha256:{index_digest}")
    assert prepared.index_digest == index_digest
    assert (
        prepared.digest != index_digest
    )  # the image's manifest, as Istio (go-containerregistry's img.Digest())
    assert await prepared.fetch() == amd64
    tagged = await fetcher().prepare(registry.reference("index/pinned", "v1"))
    assert (tagged.digest, tagged.index_digest) == (prepared.digest, index_digest)
    push_wasm(registry, "index/plain", "v1", MODULE, OCI)
    plain = await fetcher().prepare(registry.reference("index/plain", "v1"))
    assert plain.index_digest is None


# --- through the module cache (the fetcher's one caller) ---


async def test_module_cache_gets_an_oci_module_from_the_registry(registry: Registry, tmp_path: Path) -> None:
    digest = push_wasm(registry, "cache/f", "v1", MODULE, ARTIFACT)
    push_wasm(registry, "cache/f", "v2", MODULE, ARTIFACT)  # the same image under another tag
    settings = WasmSettings(cache_dir=tmp_path)  # a plain-HTTP registry on loopback: not listed insecure
    cache = ModuleCache(settings, WasmMetrics(MetricsRegistry()))
    await cache.start()
    try:
        path = await cache.get(f"oci://{registry.reference('cache/f', 'v1')}", GetOptions(timeout=10))
        assert path.read_bytes() == MODULE
        assert path.name == f"{digest}.wasm"
        pinned = await cache.get(
            f"oci://{registry.reference('cache/f', 'v2')}", GetOptions(checksum=digest, timeout=10)
        )
        assert pinned == path
        with pytest.raises(FetchError) as caught:
            await cache.get(
                f"oci://{registry.reference('cache/f', 'v1')}", GetOptions(checksum="0" * 64, timeout=10)
            )
        assert caught.value.reason == metrics.CHECKSUM_MISMATCH
    finally:
        await cache.stop()


def test_pull_secret_identity_token() -> None:
    config = json.dumps({"auths": {"reg": {"auth": b64("<token>:"), "identitytoken": "refresh-me"}}}).encode()
    assert credentials_for(config, "reg") == Credentials("<token>", "", identity_token="refresh-me")


async def test_identity_token_is_exchanged_by_oauth2_refresh(stand_in: StandIn) -> None:
    await stand_in.serve_realm()
    secret = json.dumps(
        {"auths": {f"127.0.0.1:{stand_in.port}": {"auth": b64("<token>:"), "identitytoken": "refresh-me"}}}
    ).encode()
    prepared = await fetcher(pull_secret=secret).prepare(f"127.0.0.1:{stand_in.port}/bearer/f:v1")
    assert await prepared.fetch() == MODULE
    (token_request,) = stand_in.token_requests
    assert token_request.method == "POST"
    assert stand_in.token_forms[0] == {
        "grant_type": "refresh_token",
        "refresh_token": "refresh-me",
        "service": "stand-in",
        "scope": "repository:bearer/f:pull",
        "client_id": "istio-agent",
    }


# --- which layer holds the module (Istio's TestExtractDockerImage / OCIStandard / OCIArtifact cases) ---


def descriptor(media_type: str, content: bytes = b"x") -> dict[str, object]:
    return {"mediaType": media_type, "digest": f"sha256:{sha256(content)}", "size": len(content)}


def image_manifest(*layers: dict[str, object], docker: bool = False) -> dict[str, object]:
    media_type = "application/vnd.docker.distribution.manifest.v2+json" if docker else OCI_MANIFEST
    return {"schemaVersion": 2, "mediaType": media_type, "layers": list(layers)}


DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
WASM_LAYER = "application/vnd.module.wasm.content.layer.v1+wasm"


@pytest.mark.parametrize("docker", [True, False])
def test_no_layers(docker: bool) -> None:
    with pytest.raises(FetchError, match="no layers"):
        wasm_layer(image_manifest(docker=docker))


@pytest.mark.parametrize(("docker", "media_type"), [(True, DOCKER_LAYER), (False, OCI_LAYER)])
def test_compat_images_take_the_last_layer(docker: bool, media_type: str) -> None:
    last = descriptor(media_type, b"last")
    layer = wasm_layer(image_manifest(descriptor(media_type, b"first"), last, docker=docker))
    assert (layer.digest, layer.archive) == (last["digest"], True)


def test_docker_image_with_another_last_layer_type() -> None:
    with pytest.raises(FetchError, match=f"expect {DOCKER_LAYER}"):
        wasm_layer(image_manifest(descriptor(OCI_LAYER), docker=True))


def test_artifact_takes_the_wasm_layer_of_two() -> None:
    wasm = descriptor(WASM_LAYER, b"module")
    layer = wasm_layer(image_manifest(descriptor("application/vnd.module.wasm.config.v1+json"), wasm))
    assert (layer.digest, layer.archive) == (wasm["digest"], False)


@pytest.mark.parametrize("count", [1, 3])
def test_artifact_needs_exactly_two_layers(count: int) -> None:
    with pytest.raises(FetchError, match=f"it has {count} layers"):
        wasm_layer(image_manifest(*[descriptor(WASM_LAYER, bytes([n])) for n in range(count)]))


def test_artifact_without_a_wasm_layer() -> None:
    with pytest.raises(FetchError, match="no layer of type"):
        wasm_layer(image_manifest(descriptor("a/b"), descriptor("c/d")))


@pytest.mark.parametrize("digest", ["sha256:../../v2/x", "sha512:" + "a" * 128, None])
def test_layer_digest_must_be_sha256_hex(digest: str | None) -> None:
    with pytest.raises(FetchError, match="digest"):
        wasm_layer(image_manifest({"mediaType": OCI_LAYER, "digest": digest, "size": 1}))


def test_plugin_wasm_with_a_relative_path_prefix() -> None:
    assert extract_plugin(tar_gz({"./plugin.wasm": MODULE}), 1024) == MODULE
