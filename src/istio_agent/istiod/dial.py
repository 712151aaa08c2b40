"""The one way the agent reaches istiod: credentials and channels, for the CA client and the xDS proxy.

Istio builds both connections with one helper (``pilot/pkg/grpc/grpc.go`` ``ClientOptions``, used
by ``security/pkg/nodeagent/caclient/providers/citadel/client.go`` and
``pkg/istio-agent/xds_proxy.go``), and so does this module. An :class:`IstiodEndpoint` says where
istiod is and which files authenticate the agent; :class:`IstiodCredentials` reads those files each
time it is asked, so a rotated root, a re-provisioned client certificate or a refreshed token is
used by the next dial or call without restarting the agent. What to do with a connection (the CA
client's retries and channel re-use, the xDS proxy's channel per stream) stays with each client.

The rules, the same for both:

- Root: the configured file (or the OS bundle) must hold at least one certificate; blocks that are
  not certificates are dropped (``pem.py``). Anything else is a :class:`CredentialError`.
- Client certificate: presented only when both files read, parse, match and have not expired;
  otherwise the connection goes out without one and the token may still authenticate it.
- Token: one that cannot be fetched (OSError) or cannot travel in an ``authorization`` header is not
  sent; the problem is logged, never the value (see docs/compatibility.md).
- Each distinct problem is logged once: Envoy re-opens streams and the CA client retries often.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal

import grpc

from istio_agent import keepalive
from istio_agent.config import SecuritySettings, XdsSettings
from istio_agent.config.headers import is_header_value
from istio_agent.config.security import CERT_CHAIN_FILE, KEY_FILE, os_ca_bundle
from istio_agent.config.xds import DEFAULT_KEEPALIVE_INTERVAL, DEFAULT_KEEPALIVE_TIMEOUT
from istio_agent.istiod.tokens import TokenSource
from istio_agent.log import scope
from istio_agent.pem import PemError, load_key_cert_pair, parse_certificate, parse_root_bundle

Purpose = Literal["CA", "XDS"]
"""What the connection is for: it names the log scope and words the errors as Istio does."""
ChannelOptions = list[tuple[str, str | int]]

_LOG_SCOPES: dict[Purpose, str] = {"CA": "citadelclient", "XDS": "xdsproxy"}

IDLE_TIMEOUT = timedelta(milliseconds=500)
"""A channel with no call open lets its connection go after this long, and stops reconnecting.

gRPC's C-core keeps a channel reconnecting (with backoff, up to 2 minutes apart) for as long as a
call object made on it is alive, even after ``close()``: a failed stream's call lingers in
exception tracebacks and reference cycles until the garbage collector runs. With the default
idle timeout (30 minutes) a TLS failure left such channels dialling istiod with the old root for
many minutes after the agent had recovered. Every channel to istiod has a call open for all of
its useful life (an ADS stream; a CSR), so going idle between calls costs at most one handshake.
Shorter than gRPC's first reconnect backoff (1 s, less 20 % jitter): a channel whose call has
ended never dials again.
"""


class CredentialError(Exception):
    """istiod cannot be dialled with the configured files (e.g. the root is missing); the message says why."""


@dataclass(frozen=True)
class ClientCertFiles:
    """Where the client certificate for istiod lives (PROV_CERT, or the file-mounted XDS pair)."""

    chain: Path
    key: Path


@dataclass(frozen=True)
class IstiodEndpoint:
    """Where istiod is for one purpose, and which files and headers authenticate the agent to it."""

    purpose: Purpose
    address: str
    plaintext: bool
    root_cert: Path | None = None
    """None with TLS: the OS trust store (gRPC's built-in roots when the OS has no bundle)."""
    server_name: str = ""
    """TLS server name to verify; "" verifies the address's host."""
    client_cert: ClientCertFiles | None = None
    cluster_id: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    keepalive_time: timedelta = DEFAULT_KEEPALIVE_INTERVAL
    keepalive_timeout: timedelta = DEFAULT_KEEPALIVE_TIMEOUT

    @classmethod
    def for_ca(cls, settings: SecuritySettings) -> IstiodEndpoint:
        """CA_ADDR with Istio's CA root and server name; ConfigError when a required root is missing."""
        prov = settings.prov_cert
        return cls(
            purpose="CA",
            address=settings.ca_addr,
            plaintext=settings.ca_plaintext,
            root_cert=None if settings.ca_plaintext else settings.ca_root_path(),
            server_name=settings.ca_server_name,
            client_cert=ClientCertFiles(prov / CERT_CHAIN_FILE, prov / KEY_FILE)
            if prov is not None
            else None,
            cluster_id=settings.cluster_id,
            headers=dict(settings.ca_headers),
        )

    @classmethod
    def for_xds(cls, settings: XdsSettings) -> IstiodEndpoint:
        """The discovery address with the XDS root, client certificate and keepalive of ``settings``."""
        cert, key = settings.client_cert, settings.client_key
        return cls(
            purpose="XDS",
            address=settings.discovery_address,
            plaintext=settings.plaintext,
            root_cert=settings.root_ca,
            server_name=settings.server_name,
            client_cert=ClientCertFiles(cert, key) if cert is not None and key is not None else None,
            cluster_id=settings.cluster_id,
            headers=dict(settings.headers),
            keepalive_time=settings.keepalive_interval,
            keepalive_timeout=settings.keepalive_timeout,
        )


@dataclass(frozen=True)
class DialMaterial:
    """The files a TLS channel is built from, as read at one moment; different material, different channel."""

    root: bytes | None = None
    """The root bundle (canonical PEM); None: gRPC's built-in roots, or plaintext."""
    client_cert: tuple[bytes, bytes] | None = None
    """``(key, chain)`` PEM to present, or None."""


def _utc_now() -> datetime:
    return datetime.now(UTC)


def _fits_bearer_header(token: str) -> bool:
    # A header value with no space in it: a space would split "Bearer <token>" in two.
    return is_header_value(token) and " " not in token


class IstiodCredentials:
    """Reads what authenticates the agent to istiod, at each use, and dials istiod with it."""

    def __init__(
        self,
        endpoint: IstiodEndpoint,
        token_source: TokenSource | None,
        *,
        now: Callable[[], datetime] = _utc_now,
    ) -> None:
        self.endpoint = endpoint
        self._token_source = token_source
        self._now = now
        self._log = scope(_LOG_SCOPES[endpoint.purpose])
        self._last_problem: dict[str, str] = {}
        self._parsed_root: tuple[bytes, bytes] | None = None
        """The last root file read and its parsed bundle: an unchanged file is not parsed again."""

    # -- per call -----------------------------------------------------------------------------------
    def metadata(self) -> list[tuple[str, str]]:
        """Headers of one call or stream: ``clusterid`` (sent even when empty, as Istio), the extra
        headers, and ``authorization: Bearer <token>`` when there is a token to send now."""
        metadata = [("clusterid", self.endpoint.cluster_id), *self.endpoint.headers.items()]
        token = self.token()
        if token:
            metadata.append(("authorization", f"Bearer {token}"))
        return metadata

    def token(self) -> str:
        """The token to send now, or "" for none (no source, nothing to read, or unfit for a header)."""
        source = self._token_source
        if source is None:
            return ""
        try:
            token = source.token()
        except OSError as err:
            reason = err.strerror or type(err).__name__
            self._problem("token", f"failed to fetch a token from {source}: {reason}; sending no token")
            return ""
        if not _fits_bearer_header(token):
            # The value is a credential: say what is wrong with it, never what it is.
            self._problem("token", f"{source} holds characters not allowed in a header; sending no token")
            return ""
        self._last_problem.pop("token", None)
        return token

    # -- per dial -----------------------------------------------------------------------------------
    def material(self) -> DialMaterial:
        """The root and client certificate as they are on disk now; CredentialError when the root is unusable."""
        if self.endpoint.plaintext:
            return DialMaterial()
        return DialMaterial(root=self._root(), client_cert=self.client_certificate())

    def client_certificate(self) -> tuple[bytes, bytes] | None:
        """``(key, chain)`` to present now, or None.

        None when the files are missing, unreadable, unparsable, mismatched or expired: presenting
        such a certificate would only break the handshake, while istiod may still accept the token.
        """
        files = self.endpoint.client_cert
        if files is None:
            return None
        topic = "client certificate"
        try:
            chain, key = files.chain.read_bytes(), files.key.read_bytes()
        except FileNotFoundError as err:
            self._problem(
                topic, f"no client certificate at {err.filename}, connecting without one", debug=True
            )
            return None
        except OSError as err:
            self._problem(
                topic,
                f"cannot read client certificate {err.filename}: {err.strerror}, connecting without one",
            )
            return None
        try:
            load_key_cert_pair(chain, key)
            expires = parse_certificate(chain).not_valid_after_utc
        except PemError as err:
            self._problem(
                topic,
                f"ignoring client certificate {files.chain} / {files.key}: {err}, connecting without one",
            )
            return None
        if expires <= self._now():
            self._problem(
                topic,
                f"ignoring client certificate {files.chain}: expired at {expires.isoformat()}, "
                "connecting without one",
            )
            return None
        self._last_problem.pop(topic, None)
        return key, chain

    def channel_options(self) -> ChannelOptions:
        """The options every channel to istiod gets: keepalive, a private connection that is let go
        when no call uses it (:data:`IDLE_TIMEOUT`), the TLS server name."""
        endpoint = self.endpoint
        options: ChannelOptions = [
            *keepalive.client_options(endpoint.keepalive_time, endpoint.keepalive_timeout),
            # A new channel must really dial again (new root, new client certificate), never reuse a
            # connection pooled by another channel.
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.client_idle_timeout_ms", int(IDLE_TIMEOUT.total_seconds() * 1000)),
        ]
        if not endpoint.plaintext and endpoint.server_name:
            options.append(("grpc.ssl_target_name_override", endpoint.server_name))
        return options

    def dial(
        self, material: DialMaterial, extra_options: Sequence[tuple[str, str | int]] = ()
    ) -> grpc.aio.Channel:
        """A new channel to istiod built from ``material`` (see :meth:`material`), plus ``extra_options``."""
        endpoint = self.endpoint
        options = [*self.channel_options(), *extra_options]
        if endpoint.plaintext:
            self._log.debug("dialling %s at %s (plaintext)", endpoint.purpose, endpoint.address)
            return grpc.aio.insecure_channel(endpoint.address, options=options)
        key, chain = material.client_cert or (None, None)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=material.root, private_key=key, certificate_chain=chain
        )
        mode = "mTLS" if material.client_cert else "TLS"
        self._log.debug("dialling %s at %s (%s)", endpoint.purpose, endpoint.address, mode)
        return grpc.aio.secure_channel(endpoint.address, credentials, options=options)

    # -- files ---------------------------------------------------------------------------------------
    def _root(self) -> bytes | None:
        path = self.endpoint.root_cert or os_ca_bundle()
        if path is None:
            return None  # no OS bundle: gRPC's built-in roots
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CredentialError(self._missing_root(path)) from None
        except OSError as err:
            raise CredentialError(
                f"cannot read root CA file for {self.endpoint.purpose} {path}: {err.strerror}"
            ) from None
        if self._parsed_root is not None and self._parsed_root[0] == data:
            return self._parsed_root[1]  # an OS bundle takes ~30 ms to parse; it rarely changes
        try:
            bundle = parse_root_bundle(data, str(path))  # logs each block it drops, and why
        except PemError:
            raise CredentialError(
                f"failed to create TLS dial option with root certificates: no PEM certificate found in {path}"
            ) from None
        self._parsed_root = data, bundle
        return bundle

    def _missing_root(self, path: Path) -> str:
        # Istio's own words, which its users search for: the CA client's, and FindRootCAForXDS's.
        if self.endpoint.purpose == "CA":
            return f"invalid config - {self.endpoint.address} missing a root certificate {path}"
        return f"root CA file for XDS does not exist {path}"

    def _problem(self, topic: str, message: str, *, debug: bool = False) -> None:
        if self._last_problem.get(topic) == message:
            return
        self._last_problem[topic] = message
        if debug:
            self._log.debug("%s", message)
        else:
            self._log.warning("%s", message)
