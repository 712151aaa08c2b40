"""The local control plane's certificate authority: one self-signed root, workload and serving leaves.

The root lives in the state directory and is made once, so agents that trusted it keep working
across restarts. Unlike istiod, which overrides whatever SANs a CSR asks for, we refuse a CSR whose
SAN is not exactly the caller's identity: a mismatch is a client bug worth surfacing, not hiding.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from istio_agent.files import write_atomic

ROOT_CERT_FILE = "root-cert.pem"
ROOT_KEY_FILE = "root-key.pem"
ROOT_COMMON_NAME = "Istio Local CA"
ROOT_LIFETIME = timedelta(days=3650)
MIN_TTL = timedelta(seconds=1)
MAX_TTL = timedelta(days=90)
SERVING_CERT_LIFETIME = timedelta(days=365)
CLOCK_SKEW = timedelta(minutes=1)
MIN_RSA_BITS = 2048
_LOCK_FILE = ".lock"
_MAX_SHOWN = 200  # characters of a caller-supplied value quoted back in an error


class StateError(Exception):
    """The state directory cannot be used (unwritable, corrupt files); names the file, never key bytes."""


class SigningRefused(Exception):
    """The CA will not sign this CSR for this caller; ``reason`` is safe to return to the caller."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class InvalidCSR(SigningRefused):
    """The CSR itself is unusable (not PEM, bad signature, unsupported key): the request is malformed."""


@contextmanager
def locked_state_dir(state_dir: Path) -> Iterator[None]:
    """Serialise first-time creation of state files between processes (``agentctl token`` vs the server)."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(state_dir / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as err:
        raise StateError(f"cannot use state directory {state_dir}: {err.strerror or err}") from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def write_state_file(path: Path, data: bytes, mode: int) -> None:
    """Write one state file atomically; StateError names the file when it cannot be written."""
    try:
        write_atomic(path, data, mode)
    except OSError as err:
        raise StateError(f"cannot write {path}: {err.strerror or err}") from err


def new_ec_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def private_key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def load_ec_key(path: Path) -> ec.EllipticCurvePrivateKey:
    """Load a P-256 private key from the state directory."""
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as err:
        raise StateError(f"cannot read {path}: {err.strerror or err}") from err
    except (ValueError, TypeError, UnsupportedAlgorithm) as err:
        raise StateError(f"{path} is not an unencrypted PEM private key") from err
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise StateError(f"{path} is not an ECDSA P-256 private key")
    return key


def _shown(value: str) -> str:
    return value if len(value) <= _MAX_SHOWN else value[:_MAX_SHOWN] + "..."


def _now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


class LocalCA:
    """A self-signed ECDSA P-256 root that signs workload CSRs and the control plane's serving cert."""

    def __init__(self, root_key: ec.EllipticCurvePrivateKey, root_cert: x509.Certificate) -> None:
        self._key = root_key
        self._cert = root_cert
        self.root_pem: bytes = root_cert.public_bytes(serialization.Encoding.PEM)

    @property
    def root_cert(self) -> x509.Certificate:
        return self._cert

    @classmethod
    def load_or_create(cls, state_dir: Path, trust_domain: str) -> LocalCA:
        """Load the root from ``state_dir``, or make it (O = ``trust_domain``) when the directory has none."""
        key_path, cert_path = state_dir / ROOT_KEY_FILE, state_dir / ROOT_CERT_FILE
        with locked_state_dir(state_dir):
            has_key, has_cert = key_path.exists(), cert_path.exists()
            if has_key and has_cert:
                return cls._load(key_path, cert_path)
            if has_key or has_cert:
                present, missing = (key_path, cert_path) if has_key else (cert_path, key_path)
                raise StateError(
                    f"{present} exists but {missing} does not; restore it or remove both to make a new root"
                )
            key = new_ec_key()
            cert = _make_root(key, trust_domain)
            write_state_file(key_path, private_key_pem(key), 0o600)
            write_state_file(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
            return cls(key, cert)

    @classmethod
    def _load(cls, key_path: Path, cert_path: Path) -> LocalCA:
        key = load_ec_key(key_path)
        try:
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        except OSError as err:
            raise StateError(f"cannot read {cert_path}: {err.strerror or err}") from err
        except ValueError as err:
            raise StateError(f"{cert_path} is not a PEM certificate") from err
        if cert.public_key() != key.public_key():
            raise StateError(f"{cert_path} does not belong to the key in {key_path}")
        try:
            is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        except (x509.ExtensionNotFound, ValueError):
            is_ca = False
        if not is_ca:
            raise StateError(f"{cert_path} is not a CA certificate")
        return cls(key, cert)

    def sign_csr(self, csr_pem: bytes, identity: str, ttl: timedelta) -> list[str]:
        """Sign a workload CSR for ``identity``; returns ``[leaf PEM, root PEM]`` as istiod does."""
        csr = _load_csr(csr_pem)
        _check_sans(csr, identity)
        now = _now()
        ttl = min(max(ttl, MIN_TTL), MAX_TTL)
        builder = (
            self._leaf_builder(csr.public_key(), now, now + ttl)
            .add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity)]), critical=True
            )
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
        )
        leaf = builder.sign(self._key, hashes.SHA256())
        return [leaf.public_bytes(serialization.Encoding.PEM).decode(), self.root_pem.decode()]

    def issue_serving_cert(self, hosts: list[str]) -> tuple[bytes, bytes]:
        """A key and `leaf + root` chain (PEM) for the TLS port; IP hosts become IP SANs, others DNS SANs."""
        if not hosts:
            raise ValueError("a serving certificate needs at least one host")
        names: list[x509.GeneralName] = []
        for host in dict.fromkeys(hosts):
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        key = new_ec_key()
        now = _now()
        dns_names = [host for host in hosts if not _is_ip(host)]
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0])] if dns_names else [])
        leaf = (
            self._leaf_builder(key.public_key(), now, now + SERVING_CERT_LIFETIME, subject)
            .add_extension(x509.SubjectAlternativeName(names), critical=not dns_names)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        return private_key_pem(key), leaf.public_bytes(serialization.Encoding.PEM) + self.root_pem

    def _leaf_builder(
        self,
        public_key: CertificatePublicKeyTypes,
        not_before: datetime,
        not_after: datetime,
        subject: x509.Name | None = None,
    ) -> x509.CertificateBuilder:
        not_after = min(not_after, self._cert.not_valid_after_utc)
        ski = self._cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        return (
            x509.CertificateBuilder()
            .subject_name(subject or x509.Name([]))
            .issuer_name(self._cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before - CLOCK_SKEW)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=True,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
            )
        )


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _make_root(key: ec.EllipticCurvePrivateKey, trust_domain: str) -> x509.Certificate:
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, trust_domain),
            x509.NameAttribute(NameOID.COMMON_NAME, ROOT_COMMON_NAME),
        ]
    )
    now = _now()
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + ROOT_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def _load_csr(csr_pem: bytes) -> x509.CertificateSigningRequest:
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as err:
        raise InvalidCSR("CSR is not a PEM-encoded PKCS#10 certificate request") from err
    try:
        valid = csr.is_signature_valid
        key = csr.public_key()
    except (ValueError, UnsupportedAlgorithm) as err:
        raise InvalidCSR(f"CSR cannot be read: {err}") from err
    if not valid:
        raise InvalidCSR("CSR signature invalid")
    if isinstance(key, rsa.RSAPublicKey):
        if key.key_size < MIN_RSA_BITS:
            raise InvalidCSR(f"CSR RSA key has {key.key_size} bits, at least {MIN_RSA_BITS} are required")
    elif isinstance(key, ec.EllipticCurvePublicKey):
        if not isinstance(key.curve, ec.SECP256R1 | ec.SECP384R1):
            raise InvalidCSR(f"CSR uses unsupported curve {key.curve.name}; use P-256 or P-384")
    else:
        raise InvalidCSR("CSR key type is not supported; use ECDSA or RSA")
    return csr


def _check_sans(csr: x509.CertificateSigningRequest, identity: str) -> None:
    try:
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise SigningRefused("CSR has no URI SAN") from None
    except ValueError as err:
        raise InvalidCSR(f"CSR extensions cannot be read: {err}") from err
    uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    if not uris:
        raise SigningRefused("CSR has no URI SAN")
    if len(uris) > 1 or len(san) > 1:
        raise SigningRefused(
            f"CSR must request exactly one URI SAN ({identity}), it requests {len(san)} SANs"
        )
    if uris[0] != identity:
        raise SigningRefused(f"CSR requests {_shown(uris[0])} but caller is {identity}")
