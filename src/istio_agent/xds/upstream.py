"""Dialling istiod for the xDS proxy: channel options, TLS credentials and per-stream metadata.

Every downstream stream gets a fresh channel (as in Istio), and the credential files are read at
each dial: a root certificate replaced on disk, or a client certificate re-provisioned, is picked up
by the next stream without restarting the agent, while streams already open are left alone.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import grpc

from istio_agent.config.security import os_ca_bundle
from istio_agent.config.xds import XdsSettings
from istio_agent.log import scope
from istio_agent.security.credentials import FileTokenSource
from istio_agent.security.pem import PemError, load_key_cert_pair, parse_certificate, parse_root_bundle

log = scope("xdsproxy")

MAX_RECV_BYTES = 2**31 - 1
"""Istio lets istiod send messages of any size (math.MaxInt32): a large mesh has large CDS/EDS pushes."""


class DialError(Exception):
    """The upstream cannot be dialled (credentials missing or unusable); the message says why."""


def _printable_token(value: str) -> bool:
    return all(0x21 <= ord(c) < 0x7F for c in value)


class UpstreamDialer:
    """Opens channels to the discovery address with Istio's options and credentials."""

    def __init__(self, settings: XdsSettings) -> None:
        self._settings = settings
        self._tokens = FileTokenSource(settings.token_path) if settings.token_path is not None else None
        self._last_cert_problem: str | None = None

    @property
    def address(self) -> str:
        return self._settings.discovery_address

    def describe(self) -> str:
        """The upstream as shown in logs and in errors sent to Envoy (address, and TLS server name)."""
        if self._settings.plaintext:
            return f"{self.address} (plaintext)"
        return f"{self.address} (TLS, server name {self._settings.server_name})"

    def channel_options(self) -> list[tuple[str, str | int]]:
        settings = self._settings
        options: list[tuple[str, str | int]] = [
            ("grpc.keepalive_time_ms", int(settings.keepalive_interval.total_seconds() * 1000)),
            ("grpc.keepalive_timeout_ms", int(settings.keepalive_timeout.total_seconds() * 1000)),
            # An idle ADS stream sends no data for long periods; keep pinging all the same.
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.max_receive_message_length", MAX_RECV_BYTES),
            # One connection per stream, as Istio: never share a pooled connection between channels.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if not settings.plaintext and settings.server_name:
            options.append(("grpc.ssl_target_name_override", settings.server_name))
        return options

    def dial(self) -> grpc.aio.Channel:
        """A new channel; raises DialError when TLS credentials cannot be built from the files."""
        if self._settings.plaintext:
            return grpc.aio.insecure_channel(self.address, options=self.channel_options())
        return grpc.aio.secure_channel(self.address, self.credentials(), options=self.channel_options())

    def credentials(self) -> grpc.ChannelCredentials:
        key, chain = self.client_certificate() or (None, None)
        return grpc.ssl_channel_credentials(
            root_certificates=self._root(), private_key=key, certificate_chain=chain
        )

    def metadata(self) -> list[tuple[str, str]]:
        """Headers of one upstream stream: cluster id, XDS_HEADER_*, and the token read now."""
        metadata = [("clusterid", self._settings.cluster_id), *self._settings.headers.items()]
        token = self._token()
        if token:
            metadata.append(("authorization", f"Bearer {token}"))
        return metadata

    # -- credentials --------------------------------------------------------------------------------
    def _token(self) -> str:
        if self._tokens is None:
            return ""
        token = self._tokens.token()  # warns once per distinct problem, returns "" when unreadable
        if token and not _printable_token(token):
            # The value is a credential: say what is wrong with it, never what it is.
            log.warning(
                "token file %s holds characters not allowed in a header; sending no token", self._tokens.path
            )
            return ""
        return token

    def _root(self) -> bytes | None:
        path = self._settings.root_ca
        if path is None:
            bundle = os_ca_bundle()
            return bundle.read_bytes() if bundle is not None else None  # None: gRPC's built-in roots
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise DialError(f"root CA file for XDS does not exist {path}") from None
        except OSError as err:
            raise DialError(f"cannot read root CA file for XDS {path}: {err.strerror}") from None
        try:
            return parse_root_bundle(data, str(path))
        except PemError as err:
            raise DialError(str(err)) from None

    def client_certificate(self) -> tuple[bytes, bytes] | None:
        """``(key, chain)`` to present now, or None.

        None when the files are missing, unreadable, unparsable, mismatched or expired: presenting
        such a certificate would only break the handshake, while istiod may still accept the token.
        """
        cert_path, key_path = self._settings.client_cert, self._settings.client_key
        if cert_path is None or key_path is None:
            return None
        try:
            chain, key = cert_path.read_bytes(), key_path.read_bytes()
        except FileNotFoundError as err:
            self._cert_problem(f"no client certificate at {err.filename}", debug=True)
            return None
        except OSError as err:
            self._cert_problem(f"cannot read client certificate {err.filename}: {err.strerror}")
            return None
        try:
            load_key_cert_pair(chain, key)
            expires = parse_certificate(chain).not_valid_after_utc
        except PemError as err:
            self._cert_problem(f"ignoring client certificate {_name(cert_path, key_path)}: {err}")
            return None
        if expires <= datetime.now(UTC):
            self._cert_problem(f"ignoring client certificate {cert_path}: expired at {expires.isoformat()}")
            return None
        self._last_cert_problem = None
        return key, chain

    def _cert_problem(self, message: str, *, debug: bool = False) -> None:
        # Envoy reconnects often while istiod is away: one line per distinct problem.
        if message == self._last_cert_problem:
            return
        self._last_cert_problem = message
        if debug:
            log.debug("%s, connecting without one", message)
        else:
            log.warning("%s, connecting without one", message)


def _name(cert: Path, key: Path) -> str:
    return f"{cert} / {key}"
