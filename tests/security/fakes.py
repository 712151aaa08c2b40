"""Stand-ins for what a unit test cannot run: the CA (istiod's certificate service)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from istio_agent.security.model import CAError

IDENTITY = "spiffe://cluster.local/ns/ns1/sa/sa1"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


class FakeCA:
    """A fake CA in the test process: signs CSRs with a throwaway root, with knobs for failures."""

    def __init__(self) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.now(UTC)
        self.root = (
            x509.CertificateBuilder()
            .subject_name(_name("fake root"))
            .issuer_name(_name("fake root"))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=1))
            .not_valid_after(now + timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.calls = 0
        self.fail_next = 0
        self.identity_override: str | None = None
        self.answer_override: list[str] | None = None
        self.closed = False

    async def csr_sign(self, csr_pem: bytes, ttl: timedelta) -> list[str]:
        self.calls += 1
        if self.fail_next:
            self.fail_next -= 1
            raise CAError("create certificate: rpc error: code = Unavailable desc = CA is down")
        if self.answer_override is not None:
            return self.answer_override
        csr = x509.load_pem_x509_csr(csr_pem)
        identity = self.identity_override or IDENTITY
        now = datetime.now(UTC)
        leaf = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([]))
            .issuer_name(self.root.subject)
            .public_key(csr.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=1))
            .not_valid_after(now + ttl)
            .add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity)]), critical=True
            )
            .sign(self.key, hashes.SHA256())
        )
        return [pem(leaf), pem(self.root)]

    async def close(self) -> None:
        self.closed = True
