"""The one way the agent reaches istiod: credentials and channels, for the CA client, the xDS proxy and agentctl.

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

Channels are :class:`istio_agent.rpc.channel.Channel` (grpclib): a channel connects when a call
needs it, on a connection of its own, and never reconnects in the background. That makes moot
what the grpcio channels needed options for: a private subchannel pool (so that a new channel
really dials with the new root), and a short idle timeout so that a channel whose call had failed,
kept alive by a lingering reference, stopped redialling istiod with the old root after the agent
had recovered (tests/istiod/test_stale_dials.py). Keepalive is Istio's client keepalive
(``keepalive.py``): a ping every ``keepalive_time`` while a call is open, also with no data, and the
connection dropped when the answer does not come within ``keepalive_timeout``.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal

from istio_agent.config import SecuritySettings, XdsSettings
from istio_agent.config.headers import is_header_value
from istio_agent.config.security import CERT_CHAIN_FILE, KEY_FILE, os_ca_bundle
from istio_agent.config.xds import DEFAULT_KEEPALIVE_INTERVAL, DEFAULT_KEEPALIVE_TIMEOUT
from istio_agent.istiod.tokens import TokenSource
from istio_agent.log import scope
from istio_agent.pem import PemError, load_key_cert_pair, parse_certificate, parse_root_bundle
from istio_agent.rpc.channel import Channel, tls_context

Purpose = Literal["CA", "XDS"]
"""What the connection is for: it names the log scope and words the errors as Istio does."""

_LOG_SCOPES: dict[Purpose, str] = {"CA": "citadelclient", "XDS": "xdsproxy"}


MAX_RECEIVE_BYTES = 2**31 - 1
"""The largest response a channel to istiod accepts: Istio's ``ClientOptions`` (pilot/pkg/grpc/grpc.go)
lift gRPC's 4 MiB default to ``math.MaxInt32`` for the CA client and the xDS upstream alike."""


@dataclass(frozen=True)
class ChannelSettings:
    """How a channel to istiod is made, apart from the files: keepalive and the TLS server name."""

    keepalive_time: float
    keepalive_timeout: float
    server_name: str | None
    """The TLS name to verify instead of the address's host; None: the host (or plaintext)."""


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

    def channel_settings(self) -> ChannelSettings:
        """Keepalive and the TLS server name of every channel to istiod (see the module's docstring)."""
        endpoint = self.endpoint
        return ChannelSettings(
            keepalive_time=endpoint.keepalive_time.total_seconds(),
            keepalive_timeout=endpoint.keepalive_timeout.total_seconds(),
            server_name=endpoint.server_name or None if not endpoint.plaintext else None,
        )

    def channel(self, material: DialMaterial) -> Channel:
        """A new channel to istiod built from ``material`` (see :meth:`material`); it connects at its first call."""
        endpoint = self.endpoint
        settings = self.channel_settings()
        context = None
        if endpoint.plaintext:
            self._log.debug("dialling %s at %s (plaintext)", endpoint.purpose, endpoint.address)
        else:
            paths = self._client_cert_paths(material)
            try:
                context = tls_context(material.root, paths)
            except (ssl.SSLError, OSError) as err:
                if paths is None:
                    raise
                # Replaced on disk since it was read (a rotation half written): go without, as with
                # any unusable certificate; the next dial reads the files again.
                self._problem(
                    "client certificate", f"cannot load client certificate: {err}, connecting without one"
                )
                context = tls_context(material.root)
            mode = "mTLS" if material.client_cert else "TLS"
            self._log.debug("dialling %s at %s (%s)", endpoint.purpose, endpoint.address, mode)
        return Channel(
            endpoint.address,
            ssl_context=context,
            server_name=settings.server_name,
            keepalive_time=settings.keepalive_time,
            keepalive_timeout=settings.keepalive_timeout,
            max_receive_bytes=MAX_RECEIVE_BYTES,
        )

    def _client_cert_paths(self, material: DialMaterial) -> tuple[str, str] | None:
        """The files of the certificate in ``material`` (ssl loads a key pair from files only)."""
        files = self.endpoint.client_cert
        if material.client_cert is None or files is None:
            return None
        return str(files.chain), str(files.key)

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
