"""The secret manager: sources, cache, rotation, strict CA answer checks, OUTPUT_CERTS, files."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from istio_agent.config import Env, SecuritySettings
from istio_agent.metrics import PREFIX, Registry
from istio_agent.security.manager import SecretManager
from istio_agent.security.model import ROOT_CERT, WORKLOAD_KEY_CERT, SecretError
from tests.security.fakes import IDENTITY, FakeCA, pem


def make_settings(tmp_path: Path, **env: str) -> SecuritySettings:
    base = {"POD_NAMESPACE": "ns1", "SERVICE_ACCOUNT": "sa1", "ECC_SIGNATURE_ALGORITHM": "ECDSA"}
    return SecuritySettings.from_env(Env({**base, **env}), tmp_path)


class Recorder:
    def __init__(self) -> None:
        self.names: list[str] = []
        self.event = asyncio.Event()

    def __call__(self, name: str) -> None:
        self.names.append(name)
        self.event.set()

    async def wait_for(self, name: str, count: int = 1, timeout: float = 5.0) -> None:
        async def until() -> None:
            while self.names.count(name) < count:
                self.event.clear()
                await self.event.wait()

        await asyncio.wait_for(until(), timeout)


@pytest.fixture
async def ca() -> FakeCA:
    return FakeCA()


async def started(
    settings: SecuritySettings, ca: FakeCA | None, **kwargs: object
) -> tuple[SecretManager, Recorder]:
    """A started manager with a metrics registry of its own (``manager.registry`` in the tests)."""
    registry = Registry()
    manager = SecretManager(settings, ca, registry=registry, **kwargs)  # type: ignore[arg-type]
    manager.registry = registry  # type: ignore[attr-defined]
    recorder = Recorder()
    manager.add_update_callback(recorder)
    await manager.start()
    return manager, recorder


def sample(manager: SecretManager, name: str, **labels: str) -> float | None:
    registry: Registry = manager.registry  # type: ignore[attr-defined]
    return registry.sample(PREFIX + name, labels)


def leaf_of(chain: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificates(chain)[0]


async def test_first_default_signs_then_caches(tmp_path: Path, ca: FakeCA) -> None:
    manager, recorder = await started(make_settings(tmp_path), ca)
    try:
        first = await manager.generate(WORKLOAD_KEY_CERT)
        assert len(x509.load_pem_x509_certificates(first.certificate_chain)) == 2  # root included, as Istio
        leaf = leaf_of(first.certificate_chain)
        key = serialization.load_pem_private_key(first.private_key, None)
        assert leaf.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        ) == key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        assert recorder.names == [ROOT_CERT]  # a new root is announced once
        second = await manager.generate(WORKLOAD_KEY_CERT)
        assert second.certificate_chain == first.certificate_chain
        assert ca.calls == 1
        root = await manager.generate(ROOT_CERT)
        assert root.is_root and not root.private_key
        assert root.root_cert == pem(ca.root).encode().strip()  # merged form: no trailing newline
        assert ca.calls == 1
        assert sample(manager, "cert_expiry_seconds", resource_name="default") > 80000
    finally:
        await manager.stop()
    assert ca.closed


async def test_concurrent_requests_share_one_csr(tmp_path: Path, ca: FakeCA) -> None:
    manager, _ = await started(make_settings(tmp_path), ca)
    try:
        items = await asyncio.gather(*(manager.generate(WORKLOAD_KEY_CERT) for _ in range(10)))
        assert len({item.certificate_chain for item in items}) == 1
        assert ca.calls == 1
    finally:
        await manager.stop()


async def test_rotation_pushes_a_new_certificate(tmp_path: Path, ca: FakeCA) -> None:
    settings = make_settings(tmp_path, SECRET_TTL="2s", SECRET_GRACE_PERIOD_RATIO_JITTER="0")
    manager, recorder = await started(settings, ca)
    try:
        first = await manager.generate(WORKLOAD_KEY_CERT)
        await recorder.wait_for(WORKLOAD_KEY_CERT)
        second = await manager.generate(WORKLOAD_KEY_CERT)
        assert (
            leaf_of(second.certificate_chain).serial_number != leaf_of(first.certificate_chain).serial_number
        )
        assert ca.calls == 2
    finally:
        await manager.stop()


async def test_ca_outage_during_rotation_keeps_serving_current_cert(tmp_path: Path, ca: FakeCA) -> None:
    from istio_agent.backoff import ExponentialBackoff

    settings = make_settings(tmp_path, SECRET_TTL="3s", SECRET_GRACE_PERIOD_RATIO_JITTER="0")
    manager, recorder = await started(
        settings, ca, backoff=lambda: ExponentialBackoff(initial=0.05, randomization=0.0)
    )
    try:
        first = await manager.generate(WORKLOAD_KEY_CERT)
        ca.fail_next = 3
        await recorder.wait_for(WORKLOAD_KEY_CERT, timeout=8)
        assert sample(manager, "cert_rotation_failures") == 3
        rotated = await manager.generate(WORKLOAD_KEY_CERT)
        assert rotated.certificate_chain != first.certificate_chain
        assert ca.calls == 5  # first, three failures, the renewal
    finally:
        await manager.stop()


@pytest.mark.parametrize(
    ("failures", "said", "never"),
    [
        (0, "rotated workload certificate; the previous one expires at ", "expired"),
        # A 2 s certificate (whole seconds in X.509: it lives 1-2 s) is renewed with 0.5-1 s left; the
        # CA fails 3 times, 0.6 s apart, so the third failure and the renewal come after it expired.
        (3, "rotated workload certificate; the previous one expired at ", "expires at"),
    ],
    ids=["renewed-in-time", "renewed-after-expiry"],
)
async def test_rotation_log_says_whether_the_previous_certificate_expired(
    tmp_path: Path, ca: FakeCA, caplog: pytest.LogCaptureFixture, failures: int, said: str, never: str
) -> None:
    """The log said a certificate that was still valid for hours had "expired"."""
    from istio_agent.backoff import ExponentialBackoff

    caplog.set_level(logging.INFO, logger="istio.cache")
    settings = make_settings(tmp_path, SECRET_TTL="2s", SECRET_GRACE_PERIOD_RATIO_JITTER="0")
    manager, recorder = await started(
        settings, ca, backoff=lambda: ExponentialBackoff(initial=0.6, multiplier=1.0, randomization=0.0)
    )
    try:
        await manager.generate(WORKLOAD_KEY_CERT)
        ca.fail_next = failures
        await recorder.wait_for(WORKLOAD_KEY_CERT, timeout=8)
    finally:
        await manager.stop()
    rotated = [r.getMessage() for r in caplog.records if "rotated workload certificate" in r.getMessage()]
    assert len(rotated) == 1 and rotated[0].startswith(said) and never not in rotated[0], rotated
    retries = [r.getMessage() for r in caplog.records if "certificate rotation failed" in r.getMessage()]
    assert len(retries) == failures
    if failures:
        assert "(the current certificate expires at " in retries[0]
        assert "(the current certificate expired at " in retries[-1] and " ago)" in retries[-1]


async def test_during_outage_the_cached_cert_is_served(tmp_path: Path, ca: FakeCA) -> None:
    settings = make_settings(tmp_path, SECRET_TTL="1h")
    manager, _ = await started(settings, ca)
    try:
        first = await manager.generate(WORKLOAD_KEY_CERT)
        ca.fail_next = 100
        again = await manager.generate(WORKLOAD_KEY_CERT)
        assert again.certificate_chain == first.certificate_chain
    finally:
        await manager.stop()


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        (
            lambda ca: setattr(ca, "identity_override", "spiffe://cluster.local/ns/other/sa/x"),
            "expected " + IDENTITY,
        ),
        (lambda ca: setattr(ca, "answer_override", ["not a certificate", "nor this"]), "CA answer refused"),
        (lambda ca: setattr(ca, "answer_override", []), "CA answer refused"),
    ],
)
async def test_bad_ca_answers_are_refused(tmp_path: Path, ca: FakeCA, setup: object, reason: str) -> None:
    setup(ca)  # type: ignore[operator]
    manager, recorder = await started(make_settings(tmp_path), ca)
    try:
        with pytest.raises(SecretError, match=reason):
            await manager.generate(WORKLOAD_KEY_CERT)
        assert sample(manager, "ca_response_rejected") == 1
        assert recorder.names == []
    finally:
        await manager.stop()


async def test_a_bug_in_the_ca_client_is_not_taken_for_a_ca_failure(tmp_path: Path, ca: FakeCA) -> None:
    async def broken(csr_pem: bytes, ttl: object) -> list[str]:
        raise TypeError("a bug")

    ca.csr_sign = broken  # type: ignore[method-assign]
    manager, _ = await started(make_settings(tmp_path), ca)
    try:
        with pytest.raises(TypeError, match="a bug"):  # not retried for ever as "CA unavailable"
            await manager.generate(WORKLOAD_KEY_CERT)
    finally:
        await manager.stop()


async def test_ca_answer_for_another_key_is_refused(tmp_path: Path, ca: FakeCA) -> None:
    other = FakeCA()
    stolen = await FakeCA().csr_sign(
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .sign(ec.generate_private_key(ec.SECP256R1()), hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM),
        timedelta(hours=1),
    )
    del other
    ca.answer_override = stolen
    manager, _ = await started(make_settings(tmp_path), ca)
    try:
        with pytest.raises(SecretError, match="does not match our private key"):
            await manager.generate(WORKLOAD_KEY_CERT)
    finally:
        await manager.stop()


async def test_unknown_names_and_missing_ca(tmp_path: Path, ca: FakeCA) -> None:
    manager, _ = await started(make_settings(tmp_path), ca)
    try:
        with pytest.raises(SecretError, match="unknown resource name 'bogus'"):
            await manager.generate("bogus")
        with pytest.raises(SecretError):
            await manager.generate("file-root:")
    finally:
        await manager.stop()
    no_ca, _ = await started(make_settings(tmp_path), None)
    try:
        with pytest.raises(SecretError, match="ca client is nil"):
            await no_ca.generate(WORKLOAD_KEY_CERT)
    finally:
        await no_ca.stop()


async def test_prewarm_retries_until_the_ca_answers_and_writes_output(tmp_path: Path, ca: FakeCA) -> None:
    from istio_agent.backoff import ExponentialBackoff

    ca.fail_next = 2
    settings = make_settings(tmp_path, OUTPUT_CERTS="out")
    manager, _ = await started(settings, ca, backoff=lambda: ExponentialBackoff(initial=0.01))
    try:
        await asyncio.wait_for(manager.prewarm(), 5)
        out = tmp_path / "out"
        assert sorted(p.name for p in out.iterdir()) == ["cert-chain.pem", "key.pem", "root-cert.pem"]
        for path in out.iterdir():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert (out / "root-cert.pem").read_text().strip() == pem(ca.root).strip()
        assert leaf_of((out / "cert-chain.pem").read_bytes()).extensions.get_extension_for_class(
            x509.SubjectAlternativeName
        ).value.get_values_for_type(x509.UniformResourceIdentifier) == [IDENTITY]
        assert ca.calls == 3
    finally:
        await manager.stop()


def test_rotation_delay_table(tmp_path: Path) -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    hour = timedelta(hours=1)

    def delay(ratio: float, created: datetime, expires: datetime) -> timedelta:
        settings = make_settings(
            tmp_path, SECRET_GRACE_PERIOD_RATIO=str(ratio), SECRET_GRACE_PERIOD_RATIO_JITTER="0"
        )
        return SecretManager(settings, None, now=lambda: now, registry=Registry()).rotation_delay(
            created, expires
        )

    assert delay(0.5, now, now + hour) == timedelta(minutes=30)
    assert delay(0.25, now, now + hour) == timedelta(minutes=45)
    assert delay(0.75, now, now + hour) == timedelta(minutes=15)
    assert delay(1, now, now + hour) == timedelta(0)
    assert delay(0, now, now + hour) == hour
    assert delay(0.25, now + timedelta(minutes=30), now + timedelta(minutes=90)) == timedelta(minutes=75)
    assert delay(0.5, now - 2 * hour, now - hour) == timedelta(0)


def test_rotation_jitter_bounds(tmp_path: Path) -> None:
    import random

    now = datetime(2026, 1, 1, tzinfo=UTC)
    rng = random.Random(7).random
    settings = make_settings(
        tmp_path, SECRET_GRACE_PERIOD_RATIO="0.5", SECRET_GRACE_PERIOD_RATIO_JITTER="0.5"
    )
    manager = SecretManager(settings, None, now=lambda: now, rng=rng, registry=Registry())
    delays = [manager.rotation_delay(now, now + timedelta(hours=1)) for _ in range(1000)]
    assert all(timedelta(0) <= d <= timedelta(hours=1) for d in delays)
    assert min(delays) < timedelta(minutes=10) and max(delays) > timedelta(minutes=50)


# -- file-mounted certificates ----------------------------------------------------------------------


def write_pair(ca: FakeCA, directory: Path, identity: str = IDENTITY) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([])).sign(key, hashes.SHA256())
    ca.identity_override = identity
    chain = asyncio.run(ca.csr_sign(csr.public_bytes(serialization.Encoding.PEM), timedelta(hours=1)))
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return "".join(chain).encode(), key_pem


def replace_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_mounted_certs_are_served_and_watched(tmp_path: Path) -> None:
    ca = FakeCA()
    certs = tmp_path / "etc/certs"
    certs.mkdir(parents=True)
    chain, key = write_pair(ca, certs)
    (certs / "cert-chain.pem").write_bytes(chain)
    (certs / "key.pem").write_bytes(key)
    (certs / "root-cert.pem").write_text(pem(ca.root))
    new_chain, new_key = write_pair(ca, certs)

    async def scenario() -> None:
        manager, recorder = await started(make_settings(tmp_path, FILE_MOUNTED_CERTS="true"), None)
        try:
            item = await manager.generate(WORKLOAD_KEY_CERT)
            assert (item.certificate_chain, item.private_key) == (chain, key)
            root = await manager.generate(ROOT_CERT)
            assert root.root_cert.strip() == pem(ca.root).encode().strip()
            assert recorder.names == []
            # Replace the pair: certificate first, then key (a writer that is not atomic across files).
            replace_atomically(certs / "cert-chain.pem", new_chain)
            replace_atomically(certs / "key.pem", new_key)
            await recorder.wait_for(WORKLOAD_KEY_CERT)
            item = await manager.generate(WORKLOAD_KEY_CERT)
            assert (item.certificate_chain, item.private_key) == (new_chain, new_key)
            # Beyond Istio: a key-only change is pushed too.
            count = recorder.names.count(WORKLOAD_KEY_CERT)
            replace_atomically(certs / "key.pem", new_key + b"\n")
            await recorder.wait_for(WORKLOAD_KEY_CERT, count + 1)
        finally:
            await manager.stop()

    asyncio.run(scenario())


async def test_file_resources(tmp_path: Path) -> None:
    ca = FakeCA()
    other = FakeCA()
    bundle = tmp_path / "bundle.pem"
    bundle.write_text(
        pem(ca.root)
        + "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n"
        + pem(other.root)
    )
    manager, _ = await started(make_settings(tmp_path), None, file_load_timeout=0.2)
    try:
        root = await manager.generate(f"file-root:{bundle}")
        assert len(x509.load_pem_x509_certificates(root.root_cert)) == 2
        with pytest.raises(SecretError, match="no such file or directory"):
            await manager.generate(f"file-root:{tmp_path}/missing.pem")
        with pytest.raises(SecretError):
            await manager.generate(f"file-cert:{tmp_path}/missing.pem~{tmp_path}/missing-key.pem")
        empty = tmp_path / "empty.pem"
        empty.write_text("")
        with pytest.raises(SecretError):
            await manager.generate(f"file-root:{empty}")
    finally:
        await manager.stop()


NOT_A_CERTIFICATE = b"root:x:0:0:root:/root:/bin/bash\n"


def unusable_files(tmp_path: Path, ca: FakeCA) -> dict[str, tuple[str, str]]:
    """Resource names whose files can never load, each with the reason the error must give."""
    chain, key = write_pair(ca, tmp_path)
    (tmp_path / "chain.pem").write_bytes(chain)
    (tmp_path / "key.pem").write_bytes(key)
    (tmp_path / "passwd").write_bytes(NOT_A_CERTIFICATE)
    (tmp_path / "key-only.pem").write_bytes(key)
    (tmp_path / "a-dir").mkdir()
    os.mkfifo(tmp_path / "fifo")  # reading it would block a worker thread for good
    return {
        f"file-root:{tmp_path}/passwd": ("passwd", "no PEM encoded certificate found"),
        f"file-root:{tmp_path}/key-only.pem": ("key-only.pem", "not a CERTIFICATE"),
        f"file-root:{tmp_path}/a-dir": ("a-dir", "not a regular file"),
        f"file-root:{tmp_path}/fifo": ("fifo", "not a regular file"),
        f"file-cert:{tmp_path}/passwd~{tmp_path}/key.pem": ("passwd", "invalid PEM encoded certificate"),
        f"file-cert:{tmp_path}/chain.pem~{tmp_path}/passwd": ("passwd", "no PEM PRIVATE KEY block"),
        f"file-cert:{tmp_path}/chain.pem~{tmp_path}/fifo": ("fifo", "not a regular file"),
    }


async def test_files_that_can_never_load_are_refused_at_once(tmp_path: Path) -> None:
    """A file that is not what it should be was retried for the 10 s a half-written file gets."""
    ca = FakeCA()
    cases = await asyncio.to_thread(unusable_files, tmp_path, ca)  # write_pair runs its own loop
    manager, _ = await started(make_settings(tmp_path), None)  # the default 10 s retry window
    try:
        for name, (path, reason) in cases.items():
            loop = asyncio.get_running_loop()
            began = loop.time()
            with pytest.raises(SecretError) as caught:
                await asyncio.wait_for(manager.generate(name), 5)
            assert loop.time() - began < 2, name
            assert f"failed to load {tmp_path}/{path}: " in str(caught.value), name
            assert reason in str(caught.value), name
            assert sample(manager, "num_file_secret_failures_total", resource_name=name) == 1
    finally:
        await manager.stop()


async def test_files_being_written_are_still_waited_for(tmp_path: Path) -> None:
    """Missing, empty, cut short or a key not yet matching: a writer may be half-way (Istio retries 10 s)."""
    ca = FakeCA()
    chain, key = await asyncio.to_thread(write_pair, ca, tmp_path)
    other_chain, _ = await asyncio.to_thread(write_pair, ca, tmp_path)
    root, cert, key_file = tmp_path / "root.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    root.write_bytes(b"")
    cert.write_bytes(other_chain)
    key_file.write_bytes(key)
    late = tmp_path / "late.pem"
    manager, _ = await started(make_settings(tmp_path), None)
    try:
        roots = asyncio.ensure_future(manager.generate(f"file-root:{root}"))
        pair = asyncio.ensure_future(manager.generate(f"file-cert:{cert}~{key_file}"))
        appearing = asyncio.ensure_future(manager.generate(f"file-root:{late}"))
        await asyncio.sleep(0.3)
        root.write_bytes(pem(ca.root).encode()[:100])  # cut short
        await asyncio.sleep(0.3)
        assert not roots.done() and not pair.done() and not appearing.done()
        root.write_bytes(pem(ca.root).encode())
        cert.write_bytes(chain)  # the certificate now matches the key
        late.write_bytes(pem(ca.root).encode())
        assert (await asyncio.wait_for(roots, 5)).root_cert
        assert (await asyncio.wait_for(pair, 5)).certificate_chain == chain
        assert (await asyncio.wait_for(appearing, 5)).root_cert
    finally:
        await manager.stop()


async def test_trust_bundle_update_re_pushes(tmp_path: Path, ca: FakeCA) -> None:
    manager, recorder = await started(make_settings(tmp_path), ca)
    try:
        await manager.generate(WORKLOAD_KEY_CERT)
        extra = FakeCA()
        manager.update_trust_bundle(pem(extra.root).encode())
        assert recorder.names[-2:] == [ROOT_CERT, WORKLOAD_KEY_CERT]
        root = await manager.generate(ROOT_CERT)
        assert len(x509.load_pem_x509_certificates(root.root_cert)) == 2
        await manager.generate(WORKLOAD_KEY_CERT)
        assert ca.calls == 2  # the cached certificate was dropped
        manager.update_trust_bundle(pem(extra.root).encode())
        assert recorder.names.count(ROOT_CERT) == 2  # unchanged bundle: no push
    finally:
        await manager.stop()
