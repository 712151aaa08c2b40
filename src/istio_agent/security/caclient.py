"""Client of Istio's certificate service (``istio.v1.auth.IstioCertificateService``), as Citadel's.

One unary call signs a CSR. The client retries transient failures with a short exponential backoff
and, after any failure, dials a fresh channel on the next attempt so a rotated root certificate or
a newly provisioned client certificate (PROV_CERT) is used without restarting the agent. It also
re-dials whenever those files change, so an expired client certificate is not kept on the wire.
Credentials, headers and channels come from ``istiod/dial.py``, shared with the xDS proxy.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta

from google.protobuf import struct_pb2

from istio_agent import goformat
from istio_agent.config import SecuritySettings
from istio_agent.istiod.dial import CredentialError, DialMaterial, IstiodCredentials, IstiodEndpoint
from istio_agent.istiod.tokens import TokenSource, token_source_for
from istio_agent.log import scope
from istio_agent.metrics import Registry
from istio_agent.protos import istio_ca_pb2
from istio_agent.rpc import Status
from istio_agent.rpc.channel import Channel, RpcError
from istio_agent.security.model import CAError

log = scope("citadelclient")

REQUEST_TYPE = "csr"
MAX_ATTEMPTS = 5
RETRY_BASE = 0.1  # seconds before the first retry; doubles each time
RETRY_JITTER = 0.1  # +-10 %
RETRYABLE_CODES = frozenset(
    {
        Status.RESOURCE_EXHAUSTED,
        Status.ABORTED,
        Status.INTERNAL,
        Status.UNAVAILABLE,
    }
)
# Istio sets no deadline on CreateCertificate. A CA that accepts the connection and then never
# answers would stall certificate rotation forever, so each attempt gets a generous deadline.
CALL_TIMEOUT = 30.0
CREATE_CERTIFICATE = "/istio.v1.auth.IstioCertificateService/CreateCertificate"


class _CAClientMetrics:
    """The CA client's metrics (Istio's names)."""

    def __init__(self, registry: Registry) -> None:
        self.requests = registry.counter(
            "num_outgoing_requests", "Number of requests sent to the CA by the agent.", ["request_type"]
        )
        self.failures = registry.counter(
            "num_failed_outgoing_requests", "Number of requests to the CA that failed.", ["request_type"]
        )
        self.latency = registry.counter(
            "outgoing_latency", "Total time spent in requests to the CA, in milliseconds.", ["request_type"]
        )
        self.retries = registry.counter(
            "num_outgoing_retries", "Number of retried requests to the CA.", ["request_type"]
        )


@dataclass(eq=False)
class _Connection:
    channel: Channel
    material: DialMaterial
    users: int = 0
    retired: bool = False


class CitadelClient:
    """Signs CSRs with Istio's CA (istiod); safe to call concurrently."""

    def __init__(
        self,
        endpoint: IstiodEndpoint,
        token_source: TokenSource | None,
        *,
        cert_signer: str = "",
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        rng: Callable[[], float] = random.random,
        registry: Registry,
    ) -> None:
        self.endpoint = endpoint
        self._metrics = _CAClientMetrics(registry)
        self._credentials = IstiodCredentials(endpoint, token_source)
        self._cert_signer = cert_signer
        self._sleep = sleep
        self._rng = rng
        self._current: _Connection | None = None
        self._closed = False

    @classmethod
    def from_settings(cls, settings: SecuritySettings, *, registry: Registry) -> CitadelClient:
        """The agent's CA client for CA_ADDR; ConfigError when a required root certificate is missing."""
        endpoint = IstiodEndpoint.for_ca(settings)
        if endpoint.plaintext:
            log.warning(
                "Debug mode or IP-secure network: connecting to the CA at %s without TLS", endpoint.address
            )
        log.info("CA client for %s (%s)", endpoint.address, "plaintext" if endpoint.plaintext else "TLS")
        return cls(endpoint, token_source_for(settings), cert_signer=settings.cert_signer, registry=registry)

    async def csr_sign(self, csr_pem: bytes, ttl: timedelta) -> list[str]:
        """Send the CSR; return the chain as the CA sent it (leaf first, root last)."""
        labels = {"request_type": REQUEST_TYPE}
        self._metrics.requests.labels(**labels).inc()
        started = time.monotonic()
        try:
            return await self._sign(csr_pem, ttl)
        except CAError as err:  # anything else is a bug: it propagates uncounted
            self._metrics.failures.labels(**labels).inc()
            log.error("failed to sign CSR: %s", err)
            raise
        finally:
            self._metrics.latency.labels(**labels).inc((time.monotonic() - started) * 1000)

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
        metadata.update({"CertSigner": self._cert_signer})
        request = istio_ca_pb2.IstioCertificateRequest(
            csr=csr, validity_duration=int(ttl.total_seconds()), metadata=metadata
        )
        for attempt in range(1, MAX_ATTEMPTS + 1):
            conn = await self._acquire()
            failure: RpcError | None = None
            chain: list[str] = []
            try:
                response = await conn.channel.unary(
                    CREATE_CERTIFICATE,
                    request,
                    istio_ca_pb2.IstioCertificateResponse,
                    metadata=self._credentials.metadata(),
                    timeout=CALL_TIMEOUT,
                )
                chain = list(response.cert_chain)
            except RpcError as err:
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
            code, details = failure.code, failure.details
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
        self._metrics.retries.labels(request_type=REQUEST_TYPE).inc()
        log.warning("ca request failed, starting attempt %d in %s", attempt + 1, goformat.duration(delay))
        await self._sleep(delay)

    # -- channel lifecycle ------------------------------------------------------------------------
    async def _acquire(self) -> _Connection:
        if self._closed:
            raise CAError("CA client is closed")
        try:
            material = self._credentials.material()
        except CredentialError as err:
            raise CAError(str(err)) from None
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
            conn.channel.close()

    async def _retire(self, conn: _Connection) -> None:
        """Stop handing out ``conn``; close it once the calls using it are done."""
        if self._current is conn:
            self._current = None
        if conn.retired:
            return
        conn.retired = True
        if conn.users == 0:
            conn.channel.close()

    def _connect(self, material: DialMaterial) -> _Connection:
        return _Connection(self._credentials.channel(material), material)
