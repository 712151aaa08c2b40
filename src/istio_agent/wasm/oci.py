"""Wasm modules from OCI registries (``oci://`` URLs), as Istio's agent pulls them (``pkg/wasm/imagefetcher.go``).

The distribution API v2 over the project's HTTP client, every connection (token realm and redirect
hops included) dialled through the Wasm SSRF guard. In two steps, so the cache can skip the
download when it already holds the module for the manifest's digest: :meth:`ImageFetcher.prepare`
resolves the reference to an image manifest (``manifest_failure`` when it cannot: auth, a missing
tag, a manifest of no Wasm image format), :meth:`PreparedImage.fetch` downloads the module
(``download_failure``).

Image formats (the "Wasm Image Specification" Istio reads, solo-io/wasm ``spec/``):

- Docker schema2 manifest: the last layer, a tar.gz holding ``plugin.wasm``;
- OCI manifest, "compat": the last layer ``application/vnd.oci.image.layer.v1.tar+gzip`` holding it;
- OCI manifest, "oci" (artifact): exactly two layers, the module raw in the first one of type
  ``application/vnd.module.wasm.content.layer.v1+wasm``.

An index (manifest list) gives its ``linux/amd64`` image, as go-containerregistry's default
platform, or its only image whatever the platform. Auth: anonymous, Basic, or the Bearer token
flow, with the credentials of the pull secret (or the agent's own docker config when there is none).

Where we differ from Istio, on purpose:

- a module over the size limit is refused with an error saying so (Istio's ``io.LimitReader``
  silently truncates it), also when only its decompressed layer is that large;
- plain HTTP only for registries the operator listed insecure (go-containerregistry also falls back
  to it for loopback and RFC 1918 addresses), and TLS unverified for that registry's own host only,
  not for its token realm or blob storage elsewhere; no redirect from https down to plain http;
- only Bearer realms are held to the realm rules (Istio applies them to Basic realms too, which are
  names, not URLs, so it refuses every htpasswd-protected registry);
- a manifest of no Wasm format fails before any blob is downloaded, as a ``manifest_failure``
  (Istio: ``download_failure``); a pull secret's credential helpers are never run.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import hashlib
import io
import json
import re
import ssl
import tarfile
import zlib
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from istio_agent.http.client import URL, BodyTooLarge, Client, ConnectError, HTTPError, ProtocolError
from istio_agent.http.dial import Stream
from istio_agent.http.exchange import default_tls, describe
from istio_agent.http.headers import Headers
from istio_agent.log import scope
from istio_agent.wasm import metrics
from istio_agent.wasm.dockerconfig import (
    ANONYMOUS,
    DOCKER_HUB,
    Credentials,
    credentials_for,
    default_credentials,
)
from istio_agent.wasm.errors import FetchError
from istio_agent.wasm.ssrf import DialGuard, check_bearer_realm, open_guarded_stream

log = scope("wasm")

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
ACCEPT = ", ".join((OCI_MANIFEST, DOCKER_MANIFEST, OCI_INDEX, DOCKER_MANIFEST_LIST))
"""The manifest types go-containerregistry's ``remote.Get`` accepts, schema1 aside (no Wasm image is one)."""
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
WASM_LAYER = "application/vnd.module.wasm.content.layer.v1+wasm"
PLUGIN_FILE = "plugin.wasm"
DEFAULT_TAG = "latest"
DEFAULT_PLATFORM = ("linux", "amd64")
MAX_MANIFEST_BYTES = 4 << 20
"""distribution's own limit on a manifest it accepts."""
MAX_TOKEN_BYTES = 1 << 20
OAUTH_CLIENT_ID = "istio-agent"
MAX_ERROR_BYTES = 64 << 10
MAX_REDIRECTS = 10
REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})
TAR_SLACK = 64 << 10
"""Tar headers and small files the decompressed layer may hold besides a module at the size limit."""
_READ_CHUNK = 1 << 20

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_TAG = re.compile(r"[\w][\w.-]{0,127}", re.ASCII)
_DIGEST = re.compile(r"sha256:[a-f0-9]{64}")
_REGISTRY = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)(?::[0-9]{1,5})?")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_TOKEN68 = re.compile(r"\s+[A-Za-z0-9._~+/-]+=*\s*(?:,|$)")
_PARAM = re.compile(r'\s*([!#$%&\'*+.^_`|~0-9A-Za-z-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^\s,]*)\s*(?:,|$)')


@dataclass(frozen=True)
class Reference:
    """``host[:port]/repository[:tag][@sha256:hex]``: an ``oci://`` URL without its scheme."""

    registry: str
    repository: str
    tag: str | None
    digest: str | None
    """``sha256:hex``; when given, the tag (if any) is ignored, as go-containerregistry does."""

    @property
    def identifier(self) -> str:
        return self.digest or self.tag or DEFAULT_TAG

    @classmethod
    def parse(cls, text: str) -> Reference:
        """The reference, or ``FetchError`` (``manifest_failure``) saying what is wrong with it.

        The first path component is always the registry (an ``oci://`` URL's host); ``docker.io``
        is Docker Hub's ``index.docker.io``, with ``library/`` for one-component names.
        """
        rest, at, digest = text.partition("@")
        if at and not _DIGEST.fullmatch(digest):
            raise _bad_reference(text, f"digest {digest!r} is not sha256:<64 hex digits>")
        registry, slash, path = rest.partition("/")
        if not slash or not _REGISTRY.fullmatch(registry):
            raise _bad_reference(text, "expected host[:port]/repository[:tag|@sha256:digest]")
        repository, colon, tag = path.partition(":")
        if colon and not _TAG.fullmatch(tag):
            raise _bad_reference(text, f"tag {tag!r} is not valid")
        if not _REPOSITORY.fullmatch(repository):
            raise _bad_reference(text, f"repository {repository!r} is not valid (lower-case path components)")
        if registry == "docker.io":
            registry = DOCKER_HUB
        if registry == DOCKER_HUB and "/" not in repository:
            repository = f"library/{repository}"
        if at:
            return cls(registry, repository, None, digest)
        return cls(registry, repository, tag if colon else DEFAULT_TAG, None)

    def __str__(self) -> str:
        suffix = f"@{self.digest}" if self.digest else f":{self.tag}"
        return f"{self.registry}/{self.repository}{suffix}"


@dataclass(frozen=True)
class Layer:
    """The layer holding the module: raw (``artifact``) or ``plugin.wasm`` in a tar.gz."""

    media_type: str
    digest: str
    size: int
    archive: bool


class ImageFetcher:
    """Pulls Wasm images; one per fetch, as Istio makes one per fetch with that fetch's options."""

    def __init__(
        self, *, guard: DialGuard, max_bytes: int, insecure: bool, pull_secret: bytes | None
    ) -> None:
        self._guard = guard
        self._max_bytes = max_bytes
        self._insecure = insecure
        self._pull_secret = pull_secret

    async def prepare(self, reference: str) -> PreparedImage:
        """Resolve ``reference`` to an image manifest and pick its Wasm layer (``manifest_failure``)."""
        ref = Reference.parse(reference)
        log.info(
            "fetching image %s from registry %s with tag %s", ref.repository, ref.registry, ref.identifier
        )
        session = _Session(ref, self._guard, self._insecure)
        try:
            if self._pull_secret is not None:
                session.credentials = credentials_for(self._pull_secret, ref.registry)
            else:
                session.credentials = default_credentials(ref.registry)
            await session.ping()
            digest, manifest, index_digest = await _resolve(session, ref)
            layer = wasm_layer(manifest)
        except FetchError as err:
            raise session.failure(str(err), metrics.MANIFEST_FAILURE) from None
        except (HTTPError, OSError) as err:
            raise session.failure(describe(err), metrics.MANIFEST_FAILURE) from None
        finally:
            await session.close()
        return PreparedImage(session, digest, layer, self._max_bytes, index_digest)


class PreparedImage:
    """An image whose manifest is in: its digest, and the module to download when it is wanted."""

    def __init__(
        self, session: _Session, digest: str, layer: Layer, max_bytes: int, index_digest: str | None = None
    ) -> None:
        self._session = session
        self.digest = digest
        """The image manifest's sha256 (hex, no ``sha256:``): the module's checksum in the cache."""
        self.index_digest = index_digest
        """When the reference named an index: the index's sha256 (hex), which a ``@sha256:`` reference
        pins, while ``digest`` is its chosen image's (as Istio's, go-containerregistry's ``img.Digest()``)."""
        self.layer = layer
        self._max_bytes = max_bytes

    async def fetch(self) -> bytes:
        """The module; ``FetchError`` (``download_failure``) when it cannot be had or is too large."""
        layer, limit = self.layer, self._max_bytes
        try:
            if layer.size > limit:
                raise FetchError(f"layer {layer.digest} is {layer.size} bytes, {_over(limit)}")
            blob = await self._session.blob(layer.digest, limit)
            if not layer.archive:
                return blob
            return await asyncio.to_thread(extract_plugin, blob, limit)
        except FetchError as err:
            raise self._session.failure(str(err), metrics.DOWNLOAD_FAILURE) from None
        except (HTTPError, OSError) as err:
            raise self._session.failure(describe(err), metrics.DOWNLOAD_FAILURE) from None
        finally:
            await self._session.close()


class _Session:
    """One registry repository: the scheme that answered, the credentials, the Authorization to send."""

    def __init__(self, ref: Reference, guard: DialGuard, insecure: bool) -> None:
        self.ref = ref
        self.guard = guard
        self.insecure = insecure
        self.scheme = "https"
        self.credentials: Credentials = ANONYMOUS
        self.authorization: str | None = None
        self._client: Client | None = None

    async def close(self) -> None:
        """Close the kept-alive connections (a later request opens new ones)."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def failure(self, what: str, reason: str) -> FetchError:
        """An error naming the registry and repository (never a credential)."""
        return FetchError(
            f"could not fetch Wasm OCI image {self.ref.repository} from registry {self.ref.registry}: {what}",
            reason,
        )

    def url(self, path: str) -> URL:
        return URL.parse(f"{self.scheme}://{self.ref.registry}{path}")

    async def ping(self) -> None:
        """``GET /v2/``: which scheme the registry speaks, and how it wants to be authenticated."""
        try:
            status, headers, _ = await self.get(self.url("/v2/"), authorize=False)
        except (HTTPError, OSError) as err:
            if not self.insecure:
                hint = _TLS_HINT if _tls_trouble(err) else ""
                raise FetchError(f"GET {self.url('/v2/')}: {describe(err)}{hint}") from None
            log.info("fetching image with plain text from %s", self.ref)
            self.scheme = "http"
            status, headers, _ = await self.get(self.url("/v2/"), authorize=False)
        if status == 401:
            await self.authenticate(headers)
        elif status != 200:
            raise FetchError(f"GET {self.url('/v2/')}: status {status}")

    async def authenticate(self, headers: Headers) -> None:
        """Answer a 401's challenge: Basic with the credentials, or a token from the Bearer realm."""
        challenges = [c for value in headers.getall("WWW-Authenticate") for c in parse_challenges(value)]
        for scheme, params in challenges:
            if scheme == "bearer" and "realm" in params:
                try:
                    check_bearer_realm(params["realm"])
                except FetchError as err:
                    raise FetchError(f"rejected unsafe bearer realm: {err}") from None
        chosen = next(((s, p) for s, p in challenges if s in ("basic", "bearer")), None)
        if chosen is None:
            raise FetchError(f"the registry asks for authentication this client cannot give: {challenges!r}")
        scheme, params = chosen
        creds = self.credentials
        if creds.registry_token:
            self.authorization = f"Bearer {creds.registry_token}"
        elif scheme == "basic":
            self.authorization = _basic(creds) if creds.username else None
        else:
            self.authorization = f"Bearer {await self._token(params)}"

    async def _token(self, params: dict[str, str]) -> str:
        realm = params.get("realm")
        if not realm:
            raise FetchError("the registry's Bearer challenge has no realm")
        query = {"scope": f"repository:{self.ref.repository}:pull"}
        if params.get("service"):
            query = {"service": params["service"], **query}
        try:
            target = URL.parse(realm + ("&" if "?" in realm else "?") + urlencode(query))
        except HTTPError as err:
            raise FetchError(f"bearer realm: {err}") from None
        status, body = 404, b""
        if self.credentials.identity_token:
            status, body = await self._refresh(realm, query)
        if status == 404:  # no identity token, or a realm without OAuth2: the plain token GET
            headers = {"Authorization": _basic(self.credentials)} if self.credentials.username else {}
            status, _, body = await self.get(target, authorize=False, extra=headers, max_body=MAX_TOKEN_BYTES)
        if status != 200:
            raise FetchError(f"token request to {target.host} for {query['scope']}: status {status}")
        try:
            answer = json.loads(body)
            token = answer.get("token") or answer.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise FetchError(f"token response from {target.host} holds no token")
        return token

    async def _refresh(self, realm: str, query: dict[str, str]) -> tuple[int, bytes]:
        """The OAuth2 refresh-token grant docker and go-containerregistry make with an identity token."""
        form = {
            "grant_type": "refresh_token",
            "refresh_token": self.credentials.identity_token,
            **query,
            "client_id": OAUTH_CLIENT_ID,
        }
        try:
            target = URL.parse(realm)
        except HTTPError as err:
            raise FetchError(f"bearer realm: {err}") from None
        headers = {"Content-Type": "application/x-www-form-urlencoded"}
        body = urlencode(form).encode()
        status, _, answer = await self.get(
            target, method="POST", body=body, authorize=False, extra=headers, max_body=MAX_TOKEN_BYTES
        )
        return status, answer

    async def manifest(self, identifier: str) -> tuple[bytes, str]:
        """A manifest's bytes and its media type (the response's Content-Type)."""
        target = self.url(f"/v2/{self.ref.repository}/manifests/{identifier}")
        status, headers, body = await self.get(target, accept=ACCEPT, max_body=MAX_MANIFEST_BYTES)
        if status == 401 and self.authorization is None:
            await self.authenticate(headers)
            status, headers, body = await self.get(target, accept=ACCEPT, max_body=MAX_MANIFEST_BYTES)
        if status != 200:
            raise FetchError(f"manifest {identifier}: {_status(status, body)}")
        return body, headers.get("Content-Type", "").split(";")[0].strip()

    async def blob(self, digest: str, limit: int) -> bytes:
        target = self.url(f"/v2/{self.ref.repository}/blobs/{digest}")
        try:
            status, _, body = await self.get(target, max_body=limit)
        except BodyTooLarge:
            raise FetchError(f"blob {digest} is {_over(limit)}") from None
        if status != 200:
            raise FetchError(f"blob {digest}: {_status(status, body)}")
        if f"sha256:{hashlib.sha256(body).hexdigest()}" != digest:
            raise FetchError(f"blob {digest}: the content received has another digest")
        return body

    async def get(
        self,
        url: URL,
        *,
        method: str = "GET",
        body: bytes = b"",
        authorize: bool = True,
        accept: str | None = None,
        extra: dict[str, str] | None = None,
        max_body: int = MAX_ERROR_BYTES,
    ) -> tuple[int, Headers, bytes]:
        """A request (a GET following redirects); Authorization goes only to the registry itself. Bodies
        of answers other than 200 are read up to ``MAX_ERROR_BYTES`` (for the registry's error)."""
        if self._client is None:
            self._client = Client(connector=self._connect, keepalive=True)
        client = self._client
        origin = (url.scheme, url.host, url.port)
        for _ in range(MAX_REDIRECTS + 1):
            headers = Headers(extra)
            if accept:
                headers["Accept"] = accept
            if authorize and self.authorization and (url.scheme, url.host, url.port) == origin:
                headers["Authorization"] = self.authorization
            async with client.stream(method, url, headers=headers, body=body) as response:
                location = response.headers.get("Location")
                if response.status in REDIRECT_CODES and location and method == "GET":
                    url = _follow(url, location)
                    continue
                if response.status != 200:
                    return (
                        response.status,
                        response.headers,
                        await response.read(MAX_ERROR_BYTES, truncate=True),
                    )
                return response.status, response.headers, await response.read(max_body)
        raise FetchError(f"GET {url}: stopped after {MAX_REDIRECTS} redirects")

    async def _connect(self, url: URL) -> Stream:
        """Through the guard; TLS unverified only for the registry's own host when it is insecure
        (not for a token realm or blob storage elsewhere, which Istio's one transport also skips)."""
        tls = None
        if url.scheme == "https":
            own_host = url.host == URL.parse(f"https://{self.ref.registry}/").host
            tls = _unverified_tls() if self.insecure and own_host else default_tls()
        try:
            return await open_guarded_stream(url.host, url.port, tls=tls, guard=self.guard)
        except OSError as err:
            raise ConnectError(url.address, err) from None


def _tls_trouble(err: BaseException) -> bool:
    """A failed handshake or an answer that was no TLS: what a plain-HTTP or self-signed registry gives."""
    if isinstance(err, ConnectError):
        err = err.os_error
    return isinstance(err, ssl.SSLError | ProtocolError | ConnectionResetError)


def _follow(url: URL, location: str) -> URL:
    """A redirect's target; never from https down to plain http (as the HTTP fetcher)."""
    try:
        following = url.join(location)
    except (HTTPError, ValueError) as err:
        raise FetchError(f"bad redirect location {location!r}: {err}") from None
    if url.scheme == "https" and following.scheme == "http":
        raise FetchError(f"refusing the redirect from https ({url}) to plain http ({following})")
    return following


async def _resolve(session: _Session, ref: Reference) -> tuple[str, dict[str, Any], str | None]:
    """The image manifest ``ref`` names (through an index if it is one), its digest (hex), and the
    index's digest when there was one."""
    body, media_type = await session.manifest(ref.identifier)
    digest = hashlib.sha256(body).hexdigest()
    if ref.digest and f"sha256:{digest}" != ref.digest:
        raise FetchError(f"manifest {ref.digest}: the registry sent one whose digest is sha256:{digest}")
    manifest = _json(body, ref.identifier)
    media_type = manifest.get("mediaType") or media_type
    index_digest = None
    if media_type in (OCI_INDEX, DOCKER_MANIFEST_LIST) or (
        "manifests" in manifest and "layers" not in manifest
    ):
        child = _platform_manifest(manifest)
        index_digest = digest
        body, _ = await session.manifest(child)
        digest = hashlib.sha256(body).hexdigest()
        if f"sha256:{digest}" != child:
            raise FetchError(f"manifest {child}: the registry sent one whose digest is sha256:{digest}")
        manifest = _json(body, child)
        if "manifests" in manifest:
            raise FetchError(f"manifest {child}: an index within an index")
    return digest, manifest, index_digest


def _platform_manifest(index: dict[str, Any]) -> str:
    entries = index.get("manifests")
    if not isinstance(entries, list) or not entries:
        raise FetchError("the image index lists no manifests")
    for entry in entries:
        platform = entry.get("platform") if isinstance(entry, dict) else None
        if (
            isinstance(platform, dict)
            and (platform.get("os"), platform.get("architecture")) == DEFAULT_PLATFORM
        ):
            return _digest(entry)
    if len(entries) == 1:
        return _digest(entries[0])
    raise FetchError(f"the image index has no linux/amd64 image among its {len(entries)}")


def wasm_layer(manifest: dict[str, Any]) -> Layer:
    """The layer holding the module, by Istio's rules (see the module docstring)."""
    if manifest.get("schemaVersion") != 2 or not isinstance(manifest.get("layers"), list):
        raise FetchError("the manifest is not a schema 2 image manifest")
    layers = [_layer(entry) for entry in manifest["layers"]]
    if not layers:
        raise FetchError("the image has no layers")
    last = layers[-1]
    if manifest.get("mediaType") == DOCKER_MANIFEST:
        if last.media_type != DOCKER_LAYER:
            raise FetchError(f"Docker image: its last layer is {last.media_type} (expect {DOCKER_LAYER})")
        return last
    if last.media_type == OCI_LAYER:
        return last
    wasm = next((layer for layer in layers if layer.media_type == WASM_LAYER), None)
    if len(layers) == 2 and wasm is not None:
        return Layer(wasm.media_type, wasm.digest, wasm.size, archive=False)
    artifact = (
        f"it has {len(layers)} layers (expect 2)"
        if len(layers) != 2
        else f"it has no layer of type {WASM_LAYER}"
    )
    raise FetchError(
        "the image is in no Wasm image format: as a compat image, its last layer is "
        f"{last.media_type} (expect {OCI_LAYER}); as an oci image, {artifact}"
    )


def _layer(entry: object) -> Layer:
    if not isinstance(entry, dict):
        raise FetchError("the manifest has a layer that is not an object")
    size = entry.get("size")
    if not isinstance(size, int) or size < 0:
        raise FetchError("the manifest has a layer without a size")
    return Layer(str(entry.get("mediaType", "")), _digest(entry), size, archive=True)


def _digest(entry: object) -> str:
    digest = entry.get("digest") if isinstance(entry, dict) else None
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise FetchError(f"the manifest has a descriptor whose digest is not sha256: {digest!r}")
    return digest


def extract_plugin(blob: bytes, limit: int) -> bytes:
    """``plugin.wasm`` (in any directory) from a tar.gz layer, never inflating more than the limit
    allows: the module at most ``limit`` bytes, the tar at most ``TAR_SLACK`` more."""
    reader = _Bounded(gzip.GzipFile(fileobj=io.BytesIO(blob)), limit + TAR_SLACK)
    try:
        with tarfile.open(fileobj=reader, mode="r|") as archive:
            for member in archive:
                if member.name.rsplit("/", 1)[-1] != PLUGIN_FILE or not member.isfile():
                    continue
                if member.size > limit:
                    raise FetchError(f"{PLUGIN_FILE} is {member.size} bytes, {_over(limit)}")
                content = archive.extractfile(member)
                return content.read() if content is not None else b""
    except (tarfile.TarError, OSError, EOFError, zlib.error) as err:
        raise FetchError(f"the layer is not a gzip-compressed tar: {describe(err)}") from None
    raise FetchError(f"{PLUGIN_FILE} not found in the layer")


class _Bounded(io.RawIOBase):
    """A reader that refuses to give more than ``limit`` bytes (a gzip bomb stops there)."""

    def __init__(self, inner: gzip.GzipFile, limit: int) -> None:
        self._inner = inner
        self._left = limit
        self._limit = limit

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        chunk = self._inner.read(_READ_CHUNK if size < 0 else min(size, _READ_CHUNK))
        self._left -= len(chunk)
        if self._left < 0:
            raise FetchError(f"the layer decompresses to something {_over(self._limit - TAR_SLACK)}")
        return chunk


def parse_challenges(value: str) -> list[tuple[str, dict[str, str]]]:
    """The challenges of one ``WWW-Authenticate`` value: ``[(scheme lower-cased, {param: value})]``."""
    challenges: list[tuple[str, dict[str, str]]] = []
    position = 0
    while position < len(value):
        while position < len(value) and value[position] in " \t,":
            position += 1
        scheme = _TOKEN.match(value, position)
        if scheme is None:
            next_comma = value.find(",", position)
            position = len(value) if next_comma < 0 else next_comma + 1
            continue
        position = scheme.end()
        params: dict[str, str] = {}
        if (token68 := _TOKEN68.match(value, position)) is not None and "=" in token68.group().rstrip(" ,="):
            token68 = None  # a parameter (name=value), not a token68 blob
        if token68 is not None:
            challenges.append((scheme.group().lower(), params))
            position = token68.end()
            continue
        while (param := _PARAM.match(value, position)) is not None and param.end() > position:
            name, raw = param.groups()
            params[name.lower()] = re.sub(r"\\(.)", r"\1", raw[1:-1]) if raw.startswith('"') else raw
            position = param.end()
        challenges.append((scheme.group().lower(), params))
    return challenges


def _json(body: bytes, what: str) -> dict[str, Any]:
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise FetchError(f"manifest {what} is not JSON") from None
    if not isinstance(document, dict):
        raise FetchError(f"manifest {what} is not a JSON object")
    return document


def _status(status: int, body: bytes) -> str:
    """``status N`` and the registry's error codes and messages (distribution's ``{"errors": [...]}``)."""
    try:
        errors = json.loads(body).get("errors") or []
        detail = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors if isinstance(e, dict))
    except (ValueError, UnicodeDecodeError, AttributeError):
        detail = ""
    return f"status {status}" + (f" ({detail})" if detail else "")


def _basic(credentials: Credentials) -> str:
    pair = f"{credentials.username}:{credentials.password}".encode()
    return f"Basic {base64.b64encode(pair).decode()}"


def _over(limit: int) -> str:
    return f"over the limit of {limit} bytes (ISTIO_WASM_MAX_BINARY_SIZE_BYTES); refused, not truncated"


_TLS_HINT = (
    " (a registry on plain HTTP, or whose certificate is not to be verified, must be listed in"
    " WASM_INSECURE_REGISTRIES)"
)
_UNVERIFIED: ssl.SSLContext | None = None


def _unverified_tls() -> ssl.SSLContext:
    """For registries listed in ``WASM_INSECURE_REGISTRIES`` only: no certificate check."""
    global _UNVERIFIED
    if _UNVERIFIED is None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        _UNVERIFIED = context
    return _UNVERIFIED


def _bad_reference(text: str, why: str) -> FetchError:
    return FetchError(f"could not parse url in image reference {text!r}: {why}", metrics.MANIFEST_FAILURE)
