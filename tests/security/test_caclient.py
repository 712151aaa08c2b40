"""The Citadel CA client against real gRPC servers on loopback (plaintext, TLS, mTLS)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from istio_agent import goformat
from istio_agent.config import SecuritySettings
from istio_agent.istiod.dial import ClientCertFiles, IstiodEndpoint
from istio_agent.istiod.tokens import FileTokenSource, StaticTokenSource, TokenSource
from istio_agent.metrics import PREFIX, Registry
from istio_agent.protos import istio_ca_pb2
from istio_agent.rpc import Status
from istio_agent.security import caclient
from istio_agent.security.caclient import CAError, CitadelClient
from tests.grpc_stubs import istio_ca_pb2_grpc

ISTIOD = "istiod.istio-system.svc"
CHAIN = ["-----LEAF-----\n", "-----INTERMEDIATE-----\n", "-----ROOT-----"]
CSR = b"-----BEGIN CERTIFICATE REQUEST-----\nMIIB\n-----END CERTIFICATE REQUEST-----\n"
TTL = timedelta(hours=1, milliseconds=900)
CSR_LABELS = {"request_type": "csr"}


# -- certificates ---------------------------------------------------------------------------------
@dataclass
class Issued:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )


def issue(
    issuer: Issued | None,
    name: str,
    *,
    dns: Sequence[str] = (),
    uri: str = "",
    not_after: datetime | None = None,
) -> Issued:
    """A CA (issuer None: self-signed) or a leaf signed by ``issuer``."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.cert.subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(hours=2))
        .not_valid_after(not_after or now + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    if uri:
        sans.append(x509.UniformResourceIdentifier(uri))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    signer = issuer.key if issuer else key
    return Issued(builder.sign(signer, hashes.SHA256()), key)


@dataclass
class Pki:
    root: Issued
    server: Issued
    root_path: Path

    def client(self, *, expired: bool = False) -> Issued:
        not_after = datetime.now(UTC) - timedelta(hours=1) if expired else None
        return issue(
            self.root, "workload", uri="spiffe://cluster.local/ns/default/sa/vm", not_after=not_after
        )


@pytest.fixture(scope="module")
def pki_material() -> tuple[Issued, Issued]:
    root = issue(None, "test-root")
    return root, issue(root, ISTIOD, dns=[ISTIOD])


@pytest.fixture
def pki(tmp_path: Path, pki_material: tuple[Issued, Issued]) -> Pki:
    root, server = pki_material
    root_path = tmp_path / "root-cert.pem"
    root_path.write_bytes(root.cert_pem)
    return Pki(root, server, root_path)


def write_prov_cert(directory: Path, issued: Issued, *, key: bytes | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cert-chain.pem").write_bytes(issued.cert_pem)
    (directory / "key.pem").write_bytes(key if key is not None else issued.key_pem)


# -- fake CA servers ------------------------------------------------------------------------------
@dataclass
class Seen:
    request: istio_ca_pb2.IstioCertificateRequest
    metadata: dict[str, str]
    peer: str
    client_cert: str


@dataclass
class FakeCA(istio_ca_pb2_grpc.IstioCertificateServiceServicer):
    """Records every call; fails the first calls with ``failures``; checks ``token`` when set."""

    chain: list[str] = field(default_factory=lambda: list(CHAIN))
    failures: list[tuple[grpc.StatusCode, str]] = field(default_factory=list)
    token: str | None = None
    hang: bool = False
    seen: list[Seen] = field(default_factory=list)

    async def CreateCertificate(
        self, request: istio_ca_pb2.IstioCertificateRequest, context: grpc.aio.ServicerContext
    ) -> istio_ca_pb2.IstioCertificateResponse:
        metadata = {str(m.key): str(m.value) for m in context.invocation_metadata() or ()}
        certs = context.auth_context().get("x509_pem_cert", [b""])
        self.seen.append(Seen(request, metadata, context.peer(), certs[0].decode()))
        if self.hang:
            await asyncio.Event().wait()
        if self.failures:
            code, message = self.failures.pop(0)
            await context.abort(code, message)
        if self.token is not None and metadata.get("authorization") != f"Bearer {self.token}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "request authenticate failure")
        return istio_ca_pb2.IstioCertificateResponse(cert_chain=self.chain)


@contextlib.asynccontextmanager
async def serve(
    fake: FakeCA, *, server_cert: Issued | None = None, client_ca: Issued | None = None
) -> AsyncIterator[str]:
    """Serve ``fake`` on 127.0.0.1; TLS with ``server_cert``; client certs required with ``client_ca``."""
    server = grpc.aio.server()
    istio_ca_pb2_grpc.add_IstioCertificateServiceServicer_to_server(fake, server)
    if server_cert is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        credentials = grpc.ssl_server_credentials(
            [(server_cert.key_pem, server_cert.cert_pem)],
            root_certificates=client_ca.cert_pem if client_ca else None,
            require_client_auth=client_ca is not None,
        )
        port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@dataclass
class Sleeps:
    """Injected sleep: records the backoff instead of waiting."""

    delays: list[float] = field(default_factory=list)

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


def make_client(
    address: str,
    sleeps: Sleeps,
    *,
    token: TokenSource | None = None,
    pki: Pki | None = None,
    server_name: str = ISTIOD,
    prov_cert_dir: Path | None = None,
    rng: float = 0.5,
    cert_signer: str = "",
    **extra: object,
) -> CitadelClient:
    endpoint = IstiodEndpoint(
        purpose="CA",
        address=address,
        plaintext=pki is None,
        root_cert=pki.root_path if pki else None,
        server_name=server_name,
        client_cert=(
            ClientCertFiles(prov_cert_dir / "cert-chain.pem", prov_cert_dir / "key.pem")
            if prov_cert_dir
            else None
        ),
        **extra,  # type: ignore[arg-type]
    )
    registry = Registry()  # the client's own: tests read its counters, nothing global to diff
    client = CitadelClient(
        endpoint, token, cert_signer=cert_signer, sleep=sleeps, rng=lambda: rng, registry=registry
    )
    client.registry = registry  # type: ignore[attr-defined]
    return client


@contextlib.contextmanager
def metric_delta(client: CitadelClient, name: str) -> Iterator[dict[str, float]]:
    registry: Registry = client.registry  # type: ignore[attr-defined]
    before = registry.sample(PREFIX + name, CSR_LABELS) or 0.0
    result: dict[str, float] = {}
    yield result
    result["delta"] = (registry.sample(PREFIX + name, CSR_LABELS) or 0.0) - before


# -- plain requests and errors --------------------------------------------------------------------
async def test_valid_response_is_returned_unchanged(sleeps: Sleeps) -> None:
    fake = FakeCA()
    async with serve(fake) as address:
        client = make_client(address, sleeps)
        with (
            metric_delta(client, "num_outgoing_requests") as requests,
            metric_delta(client, "outgoing_latency") as latency,
        ):
            assert await client.csr_sign(CSR, TTL) == CHAIN
        await client.close()
    assert requests["delta"] == 1
    assert latency["delta"] > 0
    (seen,) = fake.seen
    assert seen.request.csr == CSR.decode()
    assert seen.request.validity_duration == 3600  # whole seconds
    assert dict(seen.request.metadata) == {"CertSigner": ""}  # always present


async def test_server_error_message_matches_istio(sleeps: Sleeps) -> None:
    fake = FakeCA(failures=[(grpc.StatusCode.UNKNOWN, "test failure")])
    async with serve(fake) as address:
        client = make_client(address, sleeps)
        with metric_delta(client, "num_failed_outgoing_requests") as failed, pytest.raises(CAError) as info:
            await client.csr_sign(CSR, TTL)
        await client.close()
    assert str(info.value) == "create certificate: rpc error: code = Unknown desc = test failure"
    assert info.value.code == Status.UNKNOWN
    assert failed["delta"] == 1
    assert len(fake.seen) == 1


@pytest.mark.parametrize("chain", [[], ["only-leaf\n"]])
async def test_short_chain_is_rejected(sleeps: Sleeps, chain: list[str]) -> None:
    async with serve(FakeCA(chain=chain)) as address:
        client = make_client(address, sleeps)
        with pytest.raises(CAError, match=r"^invalid empty CertChain$") as info:
            await client.csr_sign(CSR, TTL)
        await client.close()
    assert info.value.code is None


async def test_unavailable_is_retried_with_backoff_then_succeeds(
    sleeps: Sleeps, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="istio")
    fake = FakeCA(failures=[(grpc.StatusCode.UNAVAILABLE, "overloaded")] * 2)
    async with serve(fake) as address:
        client = make_client(address, sleeps)
        with metric_delta(client, "num_outgoing_retries") as retries:
            assert await client.csr_sign(CSR, TTL) == CHAIN
        await client.close()
    assert len(fake.seen) == 3
    assert sleeps.delays == pytest.approx([0.1, 0.2])
    assert retries["delta"] == 2
    assert "ca request failed, starting attempt 2 in 100ms" in caplog.text
    assert "ca request failed, starting attempt 3 in 200ms" in caplog.text


@pytest.mark.parametrize(("rng", "first"), [(0.0, 0.09), (1.0, 0.11)])
async def test_retries_stop_after_five_attempts(sleeps: Sleeps, rng: float, first: float) -> None:
    fake = FakeCA(failures=[(grpc.StatusCode.UNAVAILABLE, "down")] * 10)
    async with serve(fake) as address:
        client = make_client(address, sleeps, rng=rng)
        with pytest.raises(CAError, match="code = Unavailable desc = down") as info:
            await client.csr_sign(CSR, TTL)
        await client.close()
    assert info.value.code == Status.UNAVAILABLE
    assert len(fake.seen) == 5
    assert sleeps.delays == pytest.approx([first * 2**n for n in range(4)])


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL]
)
async def test_other_retryable_codes(sleeps: Sleeps, code: grpc.StatusCode) -> None:
    fake = FakeCA(failures=[(code, "try again")])
    async with serve(fake) as address:
        client = make_client(address, sleeps)
        assert await client.csr_sign(CSR, TTL) == CHAIN
        await client.close()
    assert len(fake.seen) == 2


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED],
)
async def test_non_retryable_code_is_not_retried(sleeps: Sleeps, code: grpc.StatusCode) -> None:
    fake = FakeCA(failures=[(code, "no")])
    async with serve(fake) as address:
        client = make_client(address, sleeps)
        with metric_delta(client, "num_outgoing_retries") as retries, pytest.raises(CAError) as info:
            await client.csr_sign(CSR, TTL)
        await client.close()
    assert len(fake.seen) == 1
    assert sleeps.delays == []
    assert retries["delta"] == 0
    assert info.value.code == Status(code.value[0])
    assert f"code = {goformat.status_code_name(code)} desc = no" in str(info.value)


async def test_unreachable_ca_is_retried_and_reported(sleeps: Sleeps) -> None:
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens on it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = make_client(f"127.0.0.1:{port}", sleeps)
    with pytest.raises(CAError, match=r"^create certificate: rpc error: code = Unavailable desc = "):
        await client.csr_sign(CSR, TTL)
    await client.close()
    assert len(sleeps.delays) == 4


async def test_hung_ca_hits_the_deadline_and_is_not_retried(
    sleeps: Sleeps, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(caclient, "CALL_TIMEOUT", 0.3)
    fake = FakeCA(hang=True)
    async with serve(fake) as address:
        client = make_client(address, sleeps)
        with pytest.raises(CAError, match="code = DeadlineExceeded") as info:
            await client.csr_sign(CSR, TTL)
        await client.close()
    assert info.value.code == Status.DEADLINE_EXCEEDED
    assert len(fake.seen) == 1


async def test_channel_is_rebuilt_after_a_failure_and_reused_otherwise(sleeps: Sleeps) -> None:
    fake = FakeCA(failures=[(grpc.StatusCode.UNKNOWN, "test failure")])
    async with serve(fake) as address:
        client = make_client(address, sleeps)
        with pytest.raises(CAError):
            await client.csr_sign(CSR, TTL)
        await client.csr_sign(CSR, TTL)
        await client.csr_sign(CSR, TTL)
        await client.close()
    failed, second, third = (s.peer for s in fake.seen)
    assert failed != second  # a new connection (new client port) after the failure
    assert second == third


async def test_concurrent_calls_share_the_channel(sleeps: Sleeps) -> None:
    fake = FakeCA()
    async with serve(fake) as address:
        client = make_client(address, sleeps)
        results = await asyncio.gather(*(client.csr_sign(CSR, TTL) for _ in range(5)))
        await client.close()
    assert results == [CHAIN] * 5
    assert len({s.peer for s in fake.seen}) == 1


async def test_closed_client_refuses_calls(sleeps: Sleeps) -> None:
    fake = FakeCA()
    async with serve(fake) as address:
        client = make_client(address, sleeps)
        await client.csr_sign(CSR, TTL)
        await client.close()
        await client.close()
        with pytest.raises(CAError, match="closed"):
            await client.csr_sign(CSR, TTL)
    assert len(fake.seen) == 1


async def test_non_ascii_csr_is_rejected_before_sending(sleeps: Sleeps) -> None:
    client = make_client("127.0.0.1:1", sleeps)
    with pytest.raises(CAError, match="invalid CSR"):
        await client.csr_sign("é".encode(), TTL)
    await client.close()


# -- metadata and tokens --------------------------------------------------------------------------
async def test_cluster_id_headers_and_cert_signer_arrive(sleeps: Sleeps) -> None:
    fake = FakeCA()
    async with serve(fake) as address:
        client = make_client(
            address,
            sleeps,
            cluster_id="Kubernetes",
            headers={"foo": "foo", "baz": "=baz"},
            cert_signer="istio-signer",
        )
        await client.csr_sign(CSR, TTL)
        await client.close()
    (seen,) = fake.seen
    assert seen.metadata["clusterid"] == "Kubernetes"
    assert seen.metadata["foo"] == "foo"
    assert seen.metadata["baz"] == "=baz"
    assert "authorization" not in seen.metadata  # no token source
    assert dict(seen.request.metadata) == {"CertSigner": "istio-signer"}


async def test_valid_token_is_accepted_over_plaintext(sleeps: Sleeps) -> None:
    fake = FakeCA(token="good-token")
    async with serve(fake) as address:
        client = make_client(address, sleeps, token=StaticTokenSource("good-token"))
        assert await client.csr_sign(CSR, TTL) == CHAIN
        await client.close()
    assert fake.seen[0].metadata["authorization"] == "Bearer good-token"


@pytest.mark.parametrize("token", ["", "wrong-token"])
async def test_empty_or_wrong_token_is_rejected_by_the_server(sleeps: Sleeps, token: str) -> None:
    fake = FakeCA(token="good-token")
    async with serve(fake) as address:
        client = make_client(address, sleeps, token=StaticTokenSource(token))
        with pytest.raises(CAError) as info:
            await client.csr_sign(CSR, TTL)
        await client.close()
    assert str(info.value) == (
        "create certificate: rpc error: code = Unauthenticated desc = request authenticate failure"
    )
    (seen,) = fake.seen
    if token:
        assert seen.metadata["authorization"] == f"Bearer {token}"
    else:
        assert "authorization" not in seen.metadata


async def test_token_file_is_read_for_every_call(sleeps: Sleeps, tmp_path: Path) -> None:
    token_file = tmp_path / "istio-token"
    token_file.write_text("token-1\n")
    fake = FakeCA()
    async with serve(fake) as address:
        client = make_client(address, sleeps, token=FileTokenSource(token_file))
        await client.csr_sign(CSR, TTL)
        token_file.write_text("token-2\n")
        await client.csr_sign(CSR, TTL)
        await client.close()
    assert [s.metadata["authorization"] for s in fake.seen] == ["Bearer token-1", "Bearer token-2"]


async def test_token_is_never_logged(sleeps: Sleeps, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="istio")
    fake = FakeCA(failures=[(grpc.StatusCode.UNAVAILABLE, "x"), (grpc.StatusCode.PERMISSION_DENIED, "no")])
    async with serve(fake) as address:
        client = make_client(address, sleeps, token=StaticTokenSource("very-secret-jwt"))
        with pytest.raises(CAError):
            await client.csr_sign(CSR, TTL)
        await client.close()
    assert "ca request failed" in caplog.text
    assert "very-secret-jwt" not in caplog.text
    assert "CERTIFICATE REQUEST" not in caplog.text


# -- TLS --------------------------------------------------------------------------------------------
async def test_tls_with_server_name_override(sleeps: Sleeps, pki: Pki) -> None:
    fake = FakeCA(token="t")
    async with serve(fake, server_cert=pki.server) as address:
        client = make_client(address, sleeps, pki=pki, token=StaticTokenSource("t"))
        assert await client.csr_sign(CSR, TTL) == CHAIN
        await client.close()


async def test_tls_with_wrong_server_name_fails(sleeps: Sleeps, pki: Pki) -> None:
    fake = FakeCA()
    async with serve(fake, server_cert=pki.server) as address:
        client = make_client(address, sleeps, pki=pki, server_name="other.example.com")
        with pytest.raises(CAError, match="code = Unavailable") as info:
            await client.csr_sign(CSR, TTL)
        await client.close()
    assert info.value.code == Status.UNAVAILABLE
    assert fake.seen == []


async def test_tls_against_an_untrusted_root_fails(sleeps: Sleeps, pki: Pki) -> None:
    pki.root_path.write_bytes(issue(None, "another-root").cert_pem)
    fake = FakeCA()
    async with serve(fake, server_cert=pki.server) as address:
        client = make_client(address, sleeps, pki=pki)
        with pytest.raises(CAError, match="code = Unavailable"):
            await client.csr_sign(CSR, TTL)
        await client.close()
    assert fake.seen == []


async def test_rotated_root_is_picked_up(sleeps: Sleeps, pki: Pki) -> None:
    good_root = pki.root_path.read_bytes()
    pki.root_path.write_bytes(issue(None, "old-root").cert_pem)
    fake = FakeCA()
    async with serve(fake, server_cert=pki.server) as address:
        client = make_client(address, sleeps, pki=pki)
        with pytest.raises(CAError):
            await client.csr_sign(CSR, TTL)
        pki.root_path.write_bytes(good_root)
        assert await client.csr_sign(CSR, TTL) == CHAIN
        await client.close()


@pytest.mark.parametrize("content", [b"", b"not a certificate\n", b"-----BEGIN CERTIFICATE-----\nAAAA\n"])
async def test_root_file_without_certificates_is_a_clear_error(
    sleeps: Sleeps, pki: Pki, content: bytes
) -> None:
    pki.root_path.write_bytes(content)
    fake = FakeCA()
    async with serve(fake, server_cert=pki.server) as address:
        client = make_client(address, sleeps, pki=pki)
        no_cert = r"no PEM certificate found in .*root-cert\.pem"
        with (
            metric_delta(client, "num_failed_outgoing_requests") as failed,
            pytest.raises(CAError, match=no_cert),
        ):
            await client.csr_sign(CSR, TTL)
        await client.close()
    assert fake.seen == []
    assert failed["delta"] == 1


async def test_missing_root_file_is_a_clear_error(sleeps: Sleeps, pki: Pki) -> None:
    pki.root_path.unlink()
    client = make_client("127.0.0.1:1", sleeps, pki=pki)
    with pytest.raises(CAError, match=r"missing a root certificate .*root-cert\.pem"):
        await client.csr_sign(CSR, TTL)
    await client.close()


# -- mTLS with PROV_CERT ----------------------------------------------------------------------------
async def test_prov_cert_is_presented_to_a_cert_only_server(sleeps: Sleeps, pki: Pki, tmp_path: Path) -> None:
    prov = tmp_path / "prov"
    client_cert = pki.client()
    write_prov_cert(prov, client_cert)
    fake = FakeCA()
    async with serve(fake, server_cert=pki.server, client_ca=pki.root) as address:
        client = make_client(address, sleeps, pki=pki, prov_cert_dir=prov)
        assert await client.csr_sign(CSR, TTL) == CHAIN
        await client.close()
    assert fake.seen[0].client_cert == client_cert.cert_pem.decode()
    assert "authorization" not in fake.seen[0].metadata


async def test_without_prov_cert_the_token_is_used(sleeps: Sleeps, pki: Pki, tmp_path: Path) -> None:
    prov = tmp_path / "prov"  # never populated
    token_ca = FakeCA(token="t")
    async with serve(token_ca, server_cert=pki.server) as address:
        client = make_client(address, sleeps, pki=pki, prov_cert_dir=prov, token=StaticTokenSource("t"))
        assert await client.csr_sign(CSR, TTL) == CHAIN
        await client.close()
    cert_only = FakeCA()
    async with serve(cert_only, server_cert=pki.server, client_ca=pki.root) as address:
        client = make_client(address, sleeps, pki=pki, prov_cert_dir=prov, token=StaticTokenSource("t"))
        with pytest.raises(CAError):
            await client.csr_sign(CSR, TTL)
        await client.close()
    assert cert_only.seen == []


async def test_prov_cert_appearing_later_is_used_after_the_failure(
    sleeps: Sleeps, pki: Pki, tmp_path: Path
) -> None:
    prov = tmp_path / "prov"
    fake = FakeCA()
    async with serve(fake, server_cert=pki.server, client_ca=pki.root) as address:
        client = make_client(address, sleeps, pki=pki, prov_cert_dir=prov)
        with pytest.raises(CAError):
            await client.csr_sign(CSR, TTL)
        write_prov_cert(prov, pki.client())
        assert await client.csr_sign(CSR, TTL) == CHAIN
        await client.close()
    assert len(fake.seen) == 1


async def test_rotated_prov_cert_is_presented_without_a_failure(
    sleeps: Sleeps, pki: Pki, tmp_path: Path
) -> None:
    prov = tmp_path / "prov"
    first, second = pki.client(), pki.client()
    write_prov_cert(prov, first)
    fake = FakeCA()
    async with serve(fake, server_cert=pki.server, client_ca=pki.root) as address:
        client = make_client(address, sleeps, pki=pki, prov_cert_dir=prov)
        await client.csr_sign(CSR, TTL)
        write_prov_cert(prov, second)
        await client.csr_sign(CSR, TTL)
        await client.close()
    assert [s.client_cert for s in fake.seen] == [first.cert_pem.decode(), second.cert_pem.decode()]


async def test_expired_prov_cert_is_not_presented(sleeps: Sleeps, pki: Pki, tmp_path: Path) -> None:
    prov = tmp_path / "prov"
    write_prov_cert(prov, pki.client(expired=True))
    fake = FakeCA(token="t")
    async with serve(fake, server_cert=pki.server) as address:
        client = make_client(address, sleeps, pki=pki, prov_cert_dir=prov, token=StaticTokenSource("t"))
        assert await client.csr_sign(CSR, TTL) == CHAIN
        await client.close()


# -- from settings -----------------------------------------------------------------------------------
async def test_from_settings_brings_the_endpoint_token_source_and_cert_signer(
    sleeps: Sleeps, pki: Pki, tmp_path: Path
) -> None:
    fake = FakeCA(token="test_token")
    async with serve(fake, server_cert=pki.server) as address:
        settings = SecuritySettings(
            workdir=tmp_path,
            ca_addr=address.replace("127.0.0.1", "localhost"),  # verified as istiod.istio-system.svc
            ca_addr_defaulted=False,
            ca_root_ca=str(pki.root_path),
            credential_fetcher_type="Mock",
            cluster_id="c1",
            cert_signer="signer",
        )
        client = CitadelClient.from_settings(settings, registry=Registry())
        assert client.endpoint == IstiodEndpoint.for_ca(settings)
        assert await client.csr_sign(CSR, TTL) == CHAIN
        await client.close()
    (seen,) = fake.seen
    assert seen.metadata["authorization"] == "Bearer test_token"
    assert seen.metadata["clusterid"] == "c1"
    assert dict(seen.request.metadata) == {"CertSigner": "signer"}


def test_from_settings_warns_about_plaintext(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="istio")
    settings = SecuritySettings(workdir=tmp_path, ca_addr="localhost:15010", ca_addr_defaulted=False)
    assert CitadelClient.from_settings(settings, registry=Registry()).endpoint.plaintext
    assert "connecting to the CA at localhost:15010 without TLS" in caplog.text
