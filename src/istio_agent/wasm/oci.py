"""Wasm modules from OCI registries (``oci://`` URLs), as Istio's agent pulls them (``pkg/wasm/imagefetcher.go``).

The distribution API v2 through :class:`istio_agent.wasm.guarded.GuardedClient` (every connection,
token realm and redirect hops included, dialled through the Wasm SSRF guard). In two steps, so the
cache can skip the download when it already holds the module for the manifest's digest:
:meth:`ImageFetcher.prepare` resolves the reference to an image manifest (``manifest_failure`` when
it cannot: auth, a missing tag, a manifest of no Wasm image format), :meth:`PreparedImage.fetch`
downloads the module (``download_failure``).

Here: the reference, the registry's scheme, the manifest (an index (manifest list) gives its
``linux/amd64`` image, as go-containerregistry's default platform, or its only image whatever the
platform) and the blob. Which layer holds the module, and its extraction: :mod:`.ocilayers`; the
401 challenge and tokens, with the credentials of the pull secret (or the agent's own docker config
when there is none): :mod:`.ociauth`.

Where we differ from Istio, on purpose:

- a module over the size limit is refused with an error saying so (Istio's ``io.LimitReader``
  silently truncates it);
- plain HTTP, as in Istio, for registries the operator listed insecure and for ``localhost``,
  loopback and RFC 1918 addresses (:func:`plain_http_fallback`), but only after https gave no HTTP
  answer at all, never racing it (go-containerregistry starts plain http 300 ms into a slow https
  ping, or after any https error, an HTTP error status included, and takes whichever answers first);
  and not for any other registry whose https port answers in plain HTTP: Istio then pulls again as
  if it were listed insecure (its helm-style retry on "server gave HTTP response"), which lets
  whoever sits on the path turn any pull, credentials included, into plain HTTP;
- TLS unverified for an insecure registry's own host only, not for its token realm or blob storage
  elsewhere (Istio's one transport skips verification for all); no redirect from https down to
  plain http;
- a manifest of no Wasm format fails before any blob is downloaded, as a ``manifest_failure``
  (Istio: ``download_failure``); a pull secret's credential helpers are never run.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import re
import ssl
from dataclasses import dataclass
from typing import Any

from istio_agent.http.client import URL, BodyTooLarge, ConnectError, HTTPError, ProtocolError
from istio_agent.http.exchange import Fetched, describe
from istio_agent.http.headers import Headers
from istio_agent.log import scope
from istio_agent.wasm import metrics, ociauth
from istio_agent.wasm.dockerconfig import (
    ANONYMOUS,
    DOCKER_HUB,
    Credentials,
    credentials_for,
    default_credentials,
)
from istio_agent.wasm.errors import FetchError
from istio_agent.wasm.guarded import MAX_ERROR_BYTES, GuardedClient
from istio_agent.wasm.ocilayers import (
    DIGEST,
    DOCKER_MANIFEST,
    DOCKER_MANIFEST_LIST,
    OCI_INDEX,
    OCI_MANIFEST,
    Layer,
    descriptor_digest,
    extract_plugin,
    over_limit,
    wasm_layer,
)
from istio_agent.wasm.ssrf import DialGuard

__all__ = ["ImageFetcher", "PreparedImage", "Reference", "plain_http_fallback"]

log = scope("wasm")

ACCEPT = ", ".join((OCI_MANIFEST, DOCKER_MANIFEST, OCI_INDEX, DOCKER_MANIFEST_LIST))
"""The manifest types go-containerregistry's ``remote.Get`` accepts, schema1 aside (no Wasm image is one)."""
DEFAULT_TAG = "latest"
DEFAULT_PLATFORM = ("linux", "amd64")
MAX_MANIFEST_BYTES = 4 << 20
"""distribution's own limit on a manifest it accepts."""
_PLAIN_HTTP_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in ("127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
)
"""Loopback and RFC 1918: registries tried over plain HTTP after https (see :func:`plain_http_fallback`)."""

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_TAG = re.compile(r"[\w][\w.-]{0,127}", re.ASCII)
_REGISTRY = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)(?::[0-9]{1,5})?")


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
        if at and not DIGEST.fullmatch(digest):
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
                raise FetchError(f"layer {layer.digest} is {layer.size} bytes, {over_limit(limit)}")
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
        self.insecure = insecure
        self.scheme = "https"
        self.credentials: Credentials = ANONYMOUS
        self.authorization: str | None = None
        self._host = URL.parse(f"https://{ref.registry}/").host
        self.client = GuardedClient(guard, skip_verify=self._skip_verify, keepalive=True)

    async def close(self) -> None:
        """Close the kept-alive connections (a later request opens new ones)."""
        await self.client.aclose()

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
        answer = await self._ping()
        if answer.status == 401:
            await self.authenticate(answer.headers)
        elif answer.status != 200:
            raise FetchError(f"GET {self.url('/v2/')}: status {answer.status}")

    async def _ping(self) -> Fetched:
        """``GET /v2/`` over https; over plain http when https gave no HTTP answer at all (refused,
        reset, no TLS, a certificate refused) and the registry is insecure or one
        :func:`plain_http_fallback` names (as go-containerregistry's ping: https first, then http)."""
        secure = self.url("/v2/")
        try:
            return await self.get(secure, authorize=False)
        except (HTTPError, OSError) as err:
            if not (self.insecure or plain_http_fallback(self.ref.registry)):
                hint = _PLAIN_HTTP_HINT if _tls_trouble(err) else ""
                raise FetchError(f"GET {secure}: {describe(err)}{hint}") from None
            https_error = f"GET {secure}: {describe(err)}"
            hint = _CERTIFICATE_HINT if _certificate_refused(err) and not self.insecure else ""
        log.info("fetching image with plain text from %s", self.ref)
        self.scheme = "http"
        plain = self.url("/v2/")
        try:
            answer = await self.get(plain, authorize=False)
        except (HTTPError, OSError) as err:
            raise FetchError(f"{https_error}; GET {plain}: {describe(err)}{hint}") from None
        if answer.status not in (200, 401):
            raise FetchError(f"{https_error}; GET {plain}: status {answer.status}{hint}")
        return answer

    async def authenticate(self, headers: Headers) -> None:
        """Answer a 401's challenge (see :mod:`istio_agent.wasm.ociauth`)."""
        self.authorization = await ociauth.authorization(
            self.client, headers, self.credentials, self.ref.repository
        )

    async def manifest(self, identifier: str) -> tuple[bytes, str]:
        """A manifest's bytes and its media type (the response's Content-Type)."""
        target = self.url(f"/v2/{self.ref.repository}/manifests/{identifier}")
        answer = await self.get(target, accept=ACCEPT, max_body=MAX_MANIFEST_BYTES)
        if answer.status == 401 and self.authorization is None:
            await self.authenticate(answer.headers)
            answer = await self.get(target, accept=ACCEPT, max_body=MAX_MANIFEST_BYTES)
        if answer.status != 200:
            raise FetchError(f"manifest {identifier}: {_status(answer.status, answer.body)}")
        return answer.body, answer.headers.get("Content-Type", "").split(";")[0].strip()

    async def blob(self, digest: str, limit: int) -> bytes:
        target = self.url(f"/v2/{self.ref.repository}/blobs/{digest}")
        try:
            answer = await self.get(target, max_body=limit)
        except BodyTooLarge:
            raise FetchError(f"blob {digest} is {over_limit(limit)}") from None
        if answer.status != 200:
            raise FetchError(f"blob {digest}: {_status(answer.status, answer.body)}")
        if f"sha256:{hashlib.sha256(answer.body).hexdigest()}" != digest:
            raise FetchError(f"blob {digest}: the content received has another digest")
        return answer.body

    async def get(
        self, url: URL, *, authorize: bool = True, accept: str | None = None, max_body: int = MAX_ERROR_BYTES
    ) -> Fetched:
        """A GET following redirects; the Authorization goes to the registry itself only."""
        return await self.client.fetch(
            "GET",
            url,
            headers={"Accept": accept} if accept else None,
            authorization=self.authorization if authorize else None,
            max_body=max_body,
        )

    def _skip_verify(self, url: URL) -> bool:
        """TLS unverified only for the registry's own host when it is insecure (not for a token realm
        or blob storage elsewhere, which Istio's one transport also leaves unverified)."""
        return self.insecure and url.host == self._host


def plain_http_fallback(registry: str) -> bool:
    """Whether ``registry`` (``host[:port]``) is tried over plain HTTP when https fails, without being
    listed insecure: go-containerregistry's ``name.Registry.Scheme()`` rule (``pkg/name/registry.go``),
    "http" for ``localhost``, ``*.localhost``, loopback and RFC 1918 addresses, which its ping
    (``pkg/v1/remote/transport/ping.go``) then tries after https. Istio pulls with it, so a WasmPlugin
    at ``oci://10.0.0.5:5000/...`` works without ``WASM_INSECURE_REGISTRIES``. The name as written
    decides, never what it resolves to. A little wider than go-containerregistry, which matches
    ``localhost`` only with a port and of 127/8 only ``127.0.0.1``: all are loopback all the same.
    """
    try:
        host = URL.parse(f"http://{registry}/").host
    except HTTPError:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any(address in network for network in _PLAIN_HTTP_NETWORKS)


def _certificate_refused(err: BaseException) -> bool:
    if isinstance(err, ConnectError):
        err = err.os_error
    return isinstance(err, ssl.SSLCertVerificationError)


def _tls_trouble(err: BaseException) -> bool:
    """A failed handshake or an answer that was no TLS: what a plain-HTTP or self-signed registry gives."""
    if isinstance(err, ConnectError):
        err = err.os_error
    return isinstance(err, ssl.SSLError | ProtocolError | ConnectionResetError)


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
            return descriptor_digest(entry)
    if len(entries) == 1:
        return descriptor_digest(entries[0])
    raise FetchError(f"the image index has no linux/amd64 image among its {len(entries)}")


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


_PLAIN_HTTP_HINT = (
    " (a registry on plain HTTP, or whose certificate is not to be verified, must be listed in"
    " WASM_INSECURE_REGISTRIES; without it only localhost, loopback and RFC 1918 private addresses"
    " are tried over plain HTTP)"
)
_CERTIFICATE_HINT = (
    " (a registry whose certificate is not to be verified must be listed in WASM_INSECURE_REGISTRIES)"
)


def _bad_reference(text: str, why: str) -> FetchError:
    return FetchError(f"could not parse url in image reference {text!r}: {why}", metrics.MANIFEST_FAILURE)
