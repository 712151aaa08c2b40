"""What the agent holds, for operators: the manager's snapshot and ``/debug/secrets`` (never key material)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

from istio_agent.pem import parse_certificates
from istio_agent.security.debug import certificate_files, secrets_view
from istio_agent.security.model import ROOT_CERT, WORKLOAD_KEY_CERT
from tests.security.fakes import IDENTITY, FakeCA, pem
from tests.security.test_manager import make_settings, started, write_pair


async def test_held_is_what_was_served_without_keys_and_follows_a_rotation(tmp_path: Path) -> None:
    ca = FakeCA()
    settings = make_settings(tmp_path, SECRET_TTL="2s", SECRET_GRACE_PERIOD_RATIO_JITTER="0")
    manager, recorder = await started(settings, ca)
    try:
        assert manager.held() == []
        first = await manager.generate(WORKLOAD_KEY_CERT)
        await manager.generate(ROOT_CERT)
        held = {h.resource_name: h for h in manager.held()}
        assert held[WORKLOAD_KEY_CERT].certificates == first.certificate_chain
        assert not held[WORKLOAD_KEY_CERT].is_root and held[WORKLOAD_KEY_CERT].source is None
        assert (
            held[ROOT_CERT].is_root and held[ROOT_CERT].certificates.strip() == pem(ca.root).encode().strip()
        )
        # Rotation replaces the cached certificate; before anyone asks again, the snapshot shows the new one.
        await recorder.wait_for(WORKLOAD_KEY_CERT)
        rotated = {h.resource_name: h for h in manager.held()}[WORKLOAD_KEY_CERT]
        assert rotated.certificates != first.certificate_chain
        assert (
            parse_certificates(rotated.certificates)[0].serial_number
            != parse_certificates(first.certificate_chain)[0].serial_number
        )
    finally:
        await manager.stop()


async def test_view_has_fingerprints_and_files_but_no_key(tmp_path: Path) -> None:
    ca = FakeCA()
    out = tmp_path / "out"
    manager, _ = await started(make_settings(tmp_path, OUTPUT_CERTS=str(out)), ca)
    try:
        item = await manager.generate(WORKLOAD_KEY_CERT)
        await manager.generate(ROOT_CERT)
        view = secrets_view(manager)
    finally:
        await manager.stop()
    text = json.dumps(view)
    assert "PRIVATE KEY" not in text and item.private_key.decode() not in text
    default = next(s for s in view["secrets"] if s["resource_name"] == WORKLOAD_KEY_CERT)
    assert default["kind"] == "cert_chain" and default["source"] == "ca"
    assert default["sha256"] == hashlib.sha256(item.certificate_chain).hexdigest()
    leaf = default["certificates"][0]
    assert leaf["uris"] == [IDENTITY] and not leaf["is_ca"]
    assert set(leaf) == {
        "serial_number",
        "subject",
        "issuer",
        "not_before",
        "not_after",
        "is_ca",
        "uris",
        "dns_names",
        "sha256",
    }
    files = {f["path"]: f for f in view["files"]}
    chain_file = files[str(out / "cert-chain.pem")]
    assert chain_file["md5"] == hashlib.md5((out / "cert-chain.pem").read_bytes()).hexdigest()
    assert chain_file["certificates"][0]["sha256"] == leaf["sha256"]
    assert files[str(out / "root-cert.pem")]["resource_name"] == ROOT_CERT
    assert not any(path.endswith("key.pem") for path in files)


def test_mounted_certificates_are_reported_as_their_files(tmp_path: Path) -> None:
    ca = FakeCA()
    certs = tmp_path / "etc" / "certs"
    certs.mkdir(parents=True)
    chain, key = write_pair(ca, certs)
    (certs / "cert-chain.pem").write_bytes(chain)
    (certs / "key.pem").write_bytes(key)
    (certs / "root-cert.pem").write_text(pem(ca.root))
    root_resource = f"file-root:{certs / 'root-cert.pem'}"

    async def scenario() -> tuple[list[tuple[str, Path]], dict]:
        manager, _ = await started(make_settings(tmp_path), None)
        try:
            await manager.generate(WORKLOAD_KEY_CERT)
            await manager.generate(root_resource)
            return certificate_files(manager), secrets_view(manager)
        finally:
            await manager.stop()

    files, view = asyncio.run(scenario())
    assert (WORKLOAD_KEY_CERT, certs / "cert-chain.pem") in files
    assert (root_resource, certs / "root-cert.pem") in files
    sources = {s["resource_name"]: s["source"] for s in view["secrets"]}
    assert sources[WORKLOAD_KEY_CERT] == str(certs / "cert-chain.pem")
    assert "PRIVATE KEY" not in json.dumps(view)


async def test_unreadable_files_are_reported_not_raised(tmp_path: Path) -> None:
    ca = FakeCA()
    out = tmp_path / "out"
    manager, _ = await started(make_settings(tmp_path, OUTPUT_CERTS=str(out)), ca)
    try:
        view = secrets_view(manager)  # nothing generated, nothing written yet
    finally:
        await manager.stop()
    assert view["secrets"] == []
    assert [f["error"] for f in view["files"]] == ["no such file or directory"] * 2
