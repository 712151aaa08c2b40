"""Client of Istio's certificate service (``istio.v1.auth.IstioCertificateService``), as Citadel's.

One unary call signs a CSR. The client retries transient failures with a short exponential backoff
and, after any failure, dials a fresh channel on the next attempt so a rotated root certificate or
a newly provisioned client certificate (PROV_CERT) is used without restarting the agent. It also
re-dials whenever those files change, so an expired client certificate is not kept on the wire.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from google.protobuf import struct_pb2

from istio_agent import goformat, metrics
from istio_agent.config import SecuritySettings
from istio_agent.config.security import CERT_CHAIN_FILE, KEY_FILE, os_ca_bundle
from istio_agent.log import scope
from istio_agent.protos import istio_ca_pb2, istio_ca_pb2_grpc
from istio_agent.security.credentials import TokenSource

log = scope("citadelclient")

REQUEST_TYPE = "csr"
MAX_ATTEMPTS = 5
RETRY_BASE = 0.1  # seconds before the first retry; doubles each time
RETRY_JITTER = 0.1  # +-10 %
RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
    }
)
# Istio sets no deadline on CreateCertificate. A CA that accepts the connection and then never
# answers would stall certificate rotation forever, so each attempt gets a generous deadline.
CALL_TIMEOUT = 30.0
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000

OUTGOING_REQUESTS = metrics.counter(
    "num_outgoing_requests", "Number of requests sent to the CA by the agent.", ["request_type"]
)
FAILED_OUTGOING_REQUESTS = metrics.counter(
    "num_failed_outgoing_requests", "Number of requests to the CA that failed.", ["request_type"]
)
OUTGOING_LATENCY = metrics.counter(
    "outgoing_latency", "Total time spent in requests to the CA, in milliseconds.", ["request_type"]
)
OUTGOING_RETRIES = metrics.counter(
    "num_outgoing_retries", "Number of retried requests to the CA.", ["request_type"]
)

_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----\r?\n.+?\r?\n-----END CERTIFICATE-----", re.DOTALL)


class CAError(Exception):
    """The CA did not sign the CSR; ``code`` is the gRPC status when the call itself failed."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


def _is_header_value(value: str) -> bool:
    return all(0x20 <= ord(c) < 0x7F for c in value)


@dataclass(frozen=True)
class CAClientOptions:
    """Where and how to reach the CA; built from SecuritySettings by ``from_settings``."""

    address: str
    plaintext: bool
    root_cert_path: Path | None  # None with TLS: the OS trust store
    server_name: str
    cluster_id: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    cert_signer: str = ""
    prov_cert_dir: Path | None = None

    @classmethod
    def from_settings(cls, settings: SecuritySettings) -> CAClientOptions:
        """Istio's CA dial options; raises ConfigError when a required root certificate is missing."""
        plaintext = settings.ca_plaintext
        if plaintext:
            log.warning(
                "Debug mode or IP-secure network: connecting to the CA at %s without TLS", settings.ca_addr
            )
        return cls(
            address=settings.ca_addr,
            plaintext=plaintext,
            root_cert_path=None if plaintext else settings.ca_root_path(),
            server_name=settings.ca_server_name,
            cluster_id=settings.cluster_id,
            headers=dict(settings.ca_headers),
            cert_signer=settings.cert_signer,
            prov_cert_dir=settings.prov_cert,
        )


def load_client_cert(directory: Path, now: datetime | None = None) -> tuple[bytes, bytes] | None:
    """The PROV_CERT ``(key.pem, cert-chain.pem)`` to present to the CA, or None to rely on the token.

    None when either file is missing or unreadable, the leaf does not parse or has expired, or the
    key does not parse or does not match the leaf: presenting a bad certificate would only make the
    handshake fail, while the token may still authenticate the call.
    """
    key_path, chain_path = directory / KEY_FILE, directory / CERT_CHAIN_FILE
    try:
        key_pem = key_path.read_bytes()
        chain_pem = chain_path.read_bytes()
    except FileNotFoundError:
        log.debug("no provisioning certificate in %s, using the token only", directory)
        return None
    except OSError as err:
        log.warning("cannot read provisioning certificate in %s: %s", directory, err.strerror)
        return None
    try:
        leaf = x509.load_pem_x509_certificate(chain_pem)
    except ValueError:
        log.warning("ignoring provisioning certificate %s: not a PEM certificate", chain_path)
        return None
    if leaf.not_valid_after_utc <= (now or datetime.now(UTC)):
        log.warning(
            "ignoring provisioning certificate %s: expired at %s", chain_path, leaf.not_valid_after_utc
        )
        return None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        log.warning("ignoring provisioning certificate: cannot parse private key %s", key_path)
        return None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != leaf.public_key().public_bytes(*spki):
        log.warning("ignoring provisioning certificate %s: it does not match %s", chain_path, key_path)
        return None
    return key_pem, chain_pem


def _has_pem_cert(data: bytes) -> bool:
    for block in _PEM_CERT.finditer(data):
        try:
            x509.load_pem_x509_certificate(block.group(0))
        except ValueError:
            continue
        return True
    return False


def _status_of(err: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    if isinstance(err, grpc.aio.AioRpcError):
        return err.code(), err.details() or ""
    return grpc.StatusCode.UNKNOWN, str(err)


@dataclass(frozen=True)
class _Material:
    """What a channel was dialled with; a change means the channel must be rebuilt."""

    root: bytes | None = None
    client_cert: tuple[bytes, bytes] | None = None


@dataclass(eq=False)
class _Connection:
    channel: grpc.aio.Channel
    stub: istio_ca_pb2_grpc.IstioCertificateServiceStub
    material: _Material
    users: int = 0
    retired: bool = False


class CitadelClient:
    """Signs CSRs with Istio's CA (istiod); safe to call concurrently."""

    def __init__(
        self,
        options: CAClientOptions,
        token_source: TokenSource | None,
        *,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.options = options
        self._token_source = token_source
        self._sleep = sleep
        self._rng = rng
        self._current: _Connection | None = None
        self._closed = False

    async def csr_sign(self, csr_pem: bytes, ttl: timedelta) -> list[str]:
        """Send the CSR; return the chain as the CA sent it (leaf first, root last)."""
        labels = {"request_type": REQUEST_TYPE}
        OUTGOING_REQUESTS.labels(**labels).inc()
        started = time.monotonic()
        try:
            return await self._sign(csr_pem, ttl)
        except Exception as err:  # CAError, or an unexpected gRPC/library error: count it all the same
            FAILED_OUTGOING_REQUESTS.labels(**labels).inc()
            log.error("failed to sign CSR: %s", err)
            raise
        finally:
            OUTGOING_LATENCY.labels(**labels).inc((time.monotonic() - started) * 1000)

    async def close(self) -> None:
        """Close the channel; calls still in flight finish first. Later calls fail."""
        self._closed = True
        current, self._current = self._current, None
        if current is not None:
            await self._retire(current)

    # -- one request, with retries ----------------------------------------------------------------
    async def _sign(self, csr_pem: bytes, ttl: timedelta) -> list[str]:
        try:
            csr = csr_pem.decode("ascii")
        except UnicodeDecodeError:
            raise CAError("invalid CSR: not PEM text") from None
        metadata = struct_pb2.Struct()
        metadata.update({"CertSigner": self.options.cert_signer})
        request = istio_ca_pb2.IstioCertificateRequest(
            csr=csr, validity_duration=int(ttl.total_seconds()), metadata=metadata
        )
        for attempt in range(1, MAX_ATTEMPTS + 1):
            conn = await self._acquire()
            failure: grpc.RpcError | None = None
            chain: list[str] = []
            try:
                response = await conn.stub.CreateCertificate(
                    request, metadata=self._call_metadata(), timeout=CALL_TIMEOUT
                )
                chain = list(response.cert_chain)
            except grpc.RpcError as err:
                failure = err
            finally:
                if len(chain) < 2:
                    # Any failure (also an unusable answer or cancellation) dials afresh next time.
                    await self._retire(conn)
                await self._release(conn)
            if failure is None:
                if len(chain) < 2:
                    raise CAError("invalid empty CertChain")
                return chain
            code, details = _status_of(failure)
            if code in RETRYABLE_CODES and attempt < MAX_ATTEMPTS:
                await self._backoff(attempt)
                continue
            raise CAError(
                f"create certificate: rpc error: code = {goformat.status_code_name(code)} desc = {details}",
                code,
            )
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _backoff(self, attempt: int) -> None:
        base = RETRY_BASE * 2 ** (attempt - 1)
        delay = base * (1 + RETRY_JITTER * (2 * self._rng() - 1))
        OUTGOING_RETRIES.labels(request_type=REQUEST_TYPE).inc()
        log.warning("ca request failed, starting attempt %d in %s", attempt + 1, goformat.duration(delay))
        await self._sleep(delay)

    def _call_metadata(self) -> list[tuple[str, str]]:
        metadata = [("clusterid", self.options.cluster_id), *self.options.headers.items()]
        token = self._token()
        if token:
            metadata.append(("authorization", f"Bearer {token}"))
        return metadata

    def _token(self) -> str:
        if self._token_source is None:
            return ""
        try:
            token = self._token_source.token()
        except Exception as err:
            raise CAError(f"fetch platform credential: {type(err).__name__}: {err}") from None
        if not _is_header_value(token) or " " in token:
            # Not echoed: the text is a credential.
            raise CAError("fetch platform credential: the token contains characters not allowed in a header")
        return token

    # -- channel lifecycle ------------------------------------------------------------------------
    async def _acquire(self) -> _Connection:
        if self._closed:
            raise CAError("CA client is closed")
        material = self._load_material()
        old: _Connection | None = None
        if self._current is not None and self._current.material != material:
            old, self._current = self._current, None
        if self._current is None:
            self._current = self._connect(material)
        conn = self._current
        conn.users += 1
        if old is not None:
            try:
                await self._retire(old)
            except BaseException:
                await self._release(conn)
                raise
        return conn

    async def _release(self, conn: _Connection) -> None:
        conn.users -= 1
        if conn.retired and conn.users == 0:
            await conn.channel.close()

    async def _retire(self, conn: _Connection) -> None:
        """Stop handing out ``conn``; close it once the calls using it are done."""
        if self._current is conn:
            self._current = None
        if conn.retired:
            return
        conn.retired = True
        if conn.users == 0:
            await conn.channel.close()

    def _load_material(self) -> _Material:
        if self.options.plaintext:
            return _Material()
        client_cert = None
        if self.options.prov_cert_dir is not None:
            client_cert = load_client_cert(self.options.prov_cert_dir)
        return _Material(root=self._read_root(), client_cert=client_cert)

    def _read_root(self) -> bytes | None:
        path = self.options.root_cert_path
        if path is None:
            bundle = os_ca_bundle()
            if bundle is None:
                return None  # gRPC's built-in roots
            path = bundle
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CAError(
                f"invalid config - {self.options.address} missing a root certificate {path}"
            ) from None
        except OSError as err:
            raise CAError(f"failed to read root certificate {path}: {err.strerror}") from None
        if not _has_pem_cert(data):
            raise CAError(
                f"failed to create TLS dial option with root certificates: no PEM certificate found in {path}"
            )
        return data

    def _connect(self, material: _Material) -> _Connection:
        options: list[tuple[str, str | int]] = [
            ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            # A rebuilt channel must really dial again, not reuse a pooled connection.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if self.options.plaintext:
            channel = grpc.aio.insecure_channel(self.options.address, options=options)
        else:
            if self.options.server_name:
                options.append(("grpc.ssl_target_name_override", self.options.server_name))
            key, chain = material.client_cert or (None, None)
            credentials = grpc.ssl_channel_credentials(
                root_certificates=material.root, private_key=key, certificate_chain=chain
            )
            channel = grpc.aio.secure_channel(self.options.address, credentials, options=options)
        log.debug(
            "dialling CA at %s (%s)",
            self.options.address,
            "plaintext" if self.options.plaintext else "mTLS" if material.client_cert else "TLS",
        )
        return _Connection(channel, istio_ca_pb2_grpc.IstioCertificateServiceStub(channel), material)
