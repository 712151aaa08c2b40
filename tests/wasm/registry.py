"""A real OCI registry for the Wasm tests: Debian's ``docker-registry`` (CNCF distribution 2.8) on loopback.

Images are written as an OCI layout directory here in Python and pushed with ``skopeo copy``, so what
the registry serves was stored by the registry itself (its manifest checks, its digests, its media
types), not by us. API:

- :func:`running_registry` (context manager): a registry on a free 127.0.0.1 port, storage in a
  temporary directory; ``auth=(user, password)`` puts it behind htpasswd (Basic), or with
  ``token=True`` behind distribution's token auth (Bearer) with a :class:`TokenServer` here as its
  realm; ``tls=True`` behind a self-signed certificate (for the fetcher's insecure flag).
- :func:`push_wasm`: a module as one of the three Wasm image formats Istio reads (:data:`DOCKER`,
  :data:`OCI`, :data:`ARTIFACT`); returns the manifest digest as the registry has it (hex).
- :func:`push_image`: any layers (for images that are not Wasm images); :func:`push_index`: an
  image index of per-platform Wasm images.

A test that needs the registry and finds a tool missing skips with "not installed" (CI fails it).
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import io
import json
import re
import shutil
import socket
import subprocess
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple
from urllib.parse import parse_qs, urlsplit

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from tests.security.certs import issue, key_to_pem, make_ca, new_key, to_pem

REGISTRY = "/usr/bin/docker-registry"
TOOLS = {"docker-registry": REGISTRY, "skopeo": "skopeo", "htpasswd": "htpasswd"}
START_TIMEOUT = 15.0
_LISTENING = re.compile(r'msg="listening on 127\.0\.0\.1:([0-9]+)')

DOCKER = "docker"
"""Docker schema2 manifest, the module as ``plugin.wasm`` in its (last) tar.gz layer."""
OCI = "oci"
"""OCI manifest, "compat" variant: ``plugin.wasm`` in an ``application/vnd.oci.image.layer.v1.tar+gzip`` layer."""
ARTIFACT = "artifact"
"""OCI manifest, "oci" variant: two layers, the raw module as ``application/vnd.module.wasm.content.layer.v1+wasm``."""
FORMATS = (DOCKER, OCI, ARTIFACT)

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
WASM_LAYER = "application/vnd.module.wasm.content.layer.v1+wasm"
WASM_CONFIG = "application/vnd.module.wasm.config.v1+json"


@dataclass(frozen=True)
class TokenRequest:
    """What the token server was asked: the query and the user it authenticated (``None``: anonymous)."""

    service: str
    scopes: list[str]
    user: str | None


@dataclass
class TokenServer:
    """distribution's token auth realm: JWTs (ES256, the signer's certificate in ``x5c``) granting the
    asked scope to ``users`` (HTTP Basic) and ``pull`` to anonymous callers when ``anonymous_pull``.

    The realm names it by this machine's host name (:func:`realm_host`): the fetcher refuses a realm
    that is ``localhost`` or a loopback or private IP literal (Istio's rule), not a name resolving there.
    """

    users: dict[str, str]
    anonymous_pull: bool = False
    issuer: str = "wasm-tests-issuer"
    service: str = "wasm-tests-registry"
    requests: list[TokenRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        key, cert = make_ca("wasm-tests token signer")
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        self._key = key
        self.certificate_pem = to_pem(cert)
        self._x5c = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()
        self._server: ThreadingHTTPServer | None = None

    @property
    def realm(self) -> str:
        assert self._server is not None
        return f"http://{self._host.name}:{self._server.server_address[1]}/token"

    def start(self) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, body = owner._answer(self.path, self.headers.get("Authorization"))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # quiet
                pass

        self._host = realm_host()
        self._server = ThreadingHTTPServer((self._host.address, 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _answer(self, path: str, authorization: str | None) -> tuple[int, bytes]:
        query = parse_qs(urlsplit(path).query)
        user = None
        if authorization is not None:
            scheme, _, encoded = authorization.partition(" ")
            name, _, password = base64.b64decode(encoded).decode().partition(":")
            if scheme != "Basic" or self.users.get(name) != password:
                return 401, b'{"details": "wrong user or password"}'
            user = name
        scopes = query.get("scope", [])
        self.requests.append(TokenRequest(query.get("service", [""])[0], scopes, user))
        access: list[dict[str, object]] = []
        for scope in scopes:
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            granted = actions.split(",") if user is not None else ["pull"] if self.anonymous_pull else []
            access.append(
                {"type": kind, "name": name, "actions": [a for a in granted if a in actions.split(",")]}
            )
        token = self._jwt(user or "", access)
        return 200, json.dumps({"token": token, "expires_in": 300}).encode()

    def _jwt(self, subject: str, access: list[dict[str, object]]) -> str:
        now = int(time.time())
        header = {"typ": "JWT", "alg": "ES256", "x5c": [self._x5c]}
        claims = {
            "iss": self.issuer,
            "sub": subject,
            "aud": self.service,
            "exp": now + 300,
            "nbf": now - 10,
            "iat": now,
            "jti": base64.b16encode(hashlib.sha256(str(time.monotonic_ns()).encode()).digest()[:8]).decode(),
            "access": access,
        }
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        r, s = decode_dss_signature(self._key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
        return f"{signing_input}.{_b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class RealmHost(NamedTuple):
    name: str
    """What a realm URL says: a name, which the realm rules leave to the dial guard."""
    address: str
    """Where a realm server listens: the local address the name resolves to first."""


def realm_host() -> RealmHost:
    """This machine's host name and the local IPv4 address it resolves to (``/etc/hosts`` gives one,
    loopback or the machine's own); skips the test when it has none a server can listen on."""
    name = socket.gethostname()
    try:
        address = str(socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
        with socket.socket() as sock:
            sock.bind((address, 0))
    except OSError:
        pytest.skip(f"this machine's host name {name!r} does not resolve to an address of its own")
    if name == "localhost" or name.endswith(".localhost"):
        pytest.skip("this machine's host name is localhost, which the realm rules refuse")
    return RealmHost(name, address)


@dataclass(frozen=True)
class Registry:
    """A running registry: ``host`` is ``127.0.0.1:PORT`` as an ``oci://`` reference starts."""

    host: str
    scheme: str
    credentials: tuple[str, str] | None
    root: Path
    token_server: TokenServer | None = None

    def reference(self, repo: str, tag: str = "latest") -> str:
        """``host/repo:tag``: what ``ImageFetcher.prepare`` takes."""
        return f"{self.host}/{repo}:{tag}"

    def pull_secret(self, user: str | None = None, password: str | None = None) -> bytes:
        """A docker config JSON for this registry (its own credentials unless others are given)."""
        given = self.credentials or ("", "")
        return docker_config(self.host, user or given[0], password or given[1])


def docker_config(host: str, user: str, password: str) -> bytes:
    """``{"auths": {host: {"auth": base64(user:password)}}}``, as ``kubectl create secret docker-registry``."""
    import base64

    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    return json.dumps({"auths": {host: {"auth": auth}}}).encode()


def require_tools() -> None:
    """Skip (a failure in CI) when a tool the registry needs is missing."""
    for name, path in TOOLS.items():
        if shutil.which(path) is None:
            pytest.skip(f"{name} is not installed (Debian's docker-registry, skopeo, apache2-utils)")


@contextlib.contextmanager
def running_registry(
    *,
    auth: tuple[str, str] | None = None,
    token: bool = False,
    anonymous_pull: bool = False,
    tls: bool = False,
    workdir: Path | None = None,
) -> Iterator[Registry]:
    """Start a registry and stop it on exit (its storage goes with the temporary directory).

    ``auth`` alone: htpasswd (Basic); with ``token``: a :class:`TokenServer` knowing that user
    (``anonymous_pull``: it grants pull to anyone).
    """
    require_tools()
    with contextlib.ExitStack() as stack:
        root = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="registry-")))
        token_server = None
        if token:
            token_server = TokenServer(dict([auth]) if auth else {}, anonymous_pull=anonymous_pull)
            token_server.start()
            stack.callback(token_server.stop)
        config = _config(root, auth, tls, token_server)
        log = stack.enter_context((root / "registry.log").open("wb"))
        process = subprocess.Popen([REGISTRY, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
        stack.callback(_stop, process)
        port = _wait_ready(process, root / "registry.log")
        yield Registry(f"127.0.0.1:{port}", "https" if tls else "http", auth, root, token_server)


def push_wasm(registry: Registry, repo: str, tag: str, module: bytes, fmt: str) -> str:
    """Push ``module`` as a Wasm image in format ``fmt``; the manifest's digest (hex) in the registry."""
    if fmt == ARTIFACT:
        layers = [(WASM_LAYER, module), (WASM_CONFIG, b'{"type":"envoy_proxy"}')]
        return push_image(registry, repo, tag, layers, config_media_type=WASM_CONFIG, config=b"{}")
    if fmt in (DOCKER, OCI):
        layers = [(OCI_LAYER_GZIP, tar_gz({"plugin.wasm": module}))]
        return push_image(registry, repo, tag, layers, docker=fmt == DOCKER)
    raise ValueError(f"unknown Wasm image format {fmt!r}; expected one of {FORMATS}")


def push_image(
    registry: Registry,
    repo: str,
    tag: str,
    layers: Sequence[tuple[str, bytes]],
    *,
    config_media_type: str = OCI_CONFIG,
    config: bytes | None = None,
    docker: bool = False,
) -> str:
    """Push an image of ``layers`` (media type, content); with ``docker`` skopeo converts it to
    Docker schema2 (``--format v2s2``, which renames the OCI layer types to Docker's)."""
    with tempfile.TemporaryDirectory(prefix="oci-layout-") as scratch:
        layout = Path(scratch)
        _layout_header(layout)
        manifest = _image_manifest(layout, layers, config_media_type, config)
        _write_index(layout, [_descriptor(manifest, OCI_MANIFEST, tag=tag)])
        return _skopeo_copy(registry, layout, repo, tag, ["--format", "v2s2"] if docker else [])


def push_index(registry: Registry, repo: str, tag: str, modules: dict[tuple[str, str], bytes]) -> str:
    """Push an image index of OCI-format Wasm images, one per ``(os, architecture)``; the index digest."""
    with tempfile.TemporaryDirectory(prefix="oci-layout-") as scratch:
        layout = Path(scratch)
        _layout_header(layout)
        entries = []
        for (os_name, arch), module in modules.items():
            config = json.dumps({"architecture": arch, "os": os_name, "rootfs": _rootfs()}).encode()
            layers = [(OCI_LAYER_GZIP, tar_gz({"plugin.wasm": module}))]
            manifest = _image_manifest(layout, layers, OCI_CONFIG, config)
            entry = _descriptor(manifest, OCI_MANIFEST)
            entry["platform"] = {"architecture": arch, "os": os_name}
            entries.append(entry)
        index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}).encode()
        _blob(layout, index)
        _write_index(layout, [_descriptor(index, OCI_INDEX, tag=tag)])
        return _skopeo_copy(registry, layout, repo, tag, ["--all"])


def tar_gz(files: dict[str, bytes]) -> bytes:
    """A gzip-compressed tar of regular files (fixed times, so the same files give the same digest)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            info.mode = 0o644
            archive.addfile(info, io.BytesIO(content))
    return gzip.compress(buffer.getvalue(), mtime=0)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _rootfs() -> dict[str, object]:
    return {"type": "layers", "diff_ids": []}


def _layout_header(layout: Path) -> None:
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')


def _blob(layout: Path, data: bytes) -> str:
    directory = layout / "blobs" / "sha256"
    directory.mkdir(parents=True, exist_ok=True)
    digest = sha256(data)
    (directory / digest).write_bytes(data)
    return f"sha256:{digest}"


def _descriptor(data: bytes, media_type: str, *, tag: str | None = None) -> dict[str, object]:
    entry: dict[str, object] = {
        "mediaType": media_type,
        "digest": f"sha256:{sha256(data)}",
        "size": len(data),
    }
    if tag is not None:
        entry["annotations"] = {"org.opencontainers.image.ref.name": tag}
    return entry


def _image_manifest(
    layout: Path, layers: Sequence[tuple[str, bytes]], config_media_type: str, config: bytes | None
) -> bytes:
    """Write the blobs and the manifest of one image; the manifest's bytes."""
    if config is None:
        config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": _rootfs()}).encode()
    _blob(layout, config)
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": _descriptor(config, config_media_type),
        "layers": [_descriptor(data, media_type) for media_type, data in layers],
    }
    for _, data in layers:
        _blob(layout, data)
    encoded = json.dumps(manifest).encode()
    _blob(layout, encoded)
    return encoded


def _write_index(layout: Path, manifests: list[dict[str, object]]) -> None:
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": manifests}))


def _skopeo_copy(registry: Registry, layout: Path, repo: str, tag: str, extra: list[str]) -> str:
    digest_file = layout / "pushed.digest"
    command = ["skopeo", "copy", "--quiet", "--dest-tls-verify=false", "--digestfile", str(digest_file)]
    if registry.credentials is not None:
        command += ["--dest-creds", ":".join(registry.credentials)]
    command += [*extra, f"oci:{layout}:{tag}", f"docker://{registry.host}/{repo}:{tag}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"skopeo copy to {registry.host}/{repo}:{tag} failed: {done.stderr.strip()}")
    return digest_file.read_text().strip().removeprefix("sha256:")


def _config(root: Path, auth: tuple[str, str] | None, tls: bool, token_server: TokenServer | None) -> Path:
    config: dict[str, object] = {
        "version": 0.1,
        "log": {"level": "info", "accesslog": {"disabled": True}},  # info: "listening on ADDRESS"
        "storage": {"filesystem": {"rootdirectory": str(root / "storage")}, "delete": {"enabled": True}},
        "http": {"addr": "127.0.0.1:0", "secret": "wasm-tests"},
    }
    http = config["http"]
    assert isinstance(http, dict)
    if token_server is not None:
        (root / "token-signer.pem").write_bytes(token_server.certificate_pem)
        config["auth"] = {
            "token": {
                "realm": token_server.realm,
                "service": token_server.service,
                "issuer": token_server.issuer,
                "rootcertbundle": str(root / "token-signer.pem"),
            }
        }
    elif auth is not None:
        user, password = auth
        entry = subprocess.run(
            ["htpasswd", "-Bbn", user, password], capture_output=True, text=True, check=True
        ).stdout.strip()
        (root / "htpasswd").write_text(entry + "\n")
        config["auth"] = {"htpasswd": {"realm": "wasm-tests", "path": str(root / "htpasswd")}}
    if tls:
        ca_key, ca = make_ca("registry test CA")
        key = new_key()
        cert = issue(ca_key, ca, public_key=key.public_key(), dns_sans=["registry.test"])
        (root / "cert.pem").write_bytes(to_pem(cert) + to_pem(ca))
        (root / "key.pem").write_bytes(key_to_pem(key))
        http["tls"] = {"certificate": str(root / "cert.pem"), "key": str(root / "key.pem")}
    path = root / "config.yml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def _wait_ready(process: subprocess.Popen[bytes], log: Path) -> int:
    """The port the registry listens on (it binds port 0 and logs the address once it listens, so no
    other process can take the port between our choosing it and the registry binding it)."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"docker-registry exited with {process.returncode}: {log.read_text()[-2000:]}")
        listening = _LISTENING.search(log.read_text())
        if listening is not None:
            return int(listening.group(1))
        time.sleep(0.02)
    raise RuntimeError(
        f"docker-registry did not log its address in {START_TIMEOUT}s: {log.read_text()[-2000:]}"
    )


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
