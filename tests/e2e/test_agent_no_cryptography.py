"""A running sidecar agent handles its certificates without the ``cryptography`` package (issue 23).

The agent runs as a real process with the local control plane and Envoy: it makes its key and CSR,
checks the CA's answer and serves the certificate to Envoy over SDS. Its memory map must then hold
no module of the ``cryptography`` package (its Rust extension is 8 MB resident) and a single
libcrypto, the one Python's ``ssl`` loaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_sds_envoy import IDENTITY, leaf_from_secret, mesh, start_pair, wait_for_secrets

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

__all__ = ["mesh"]  # the fixture, shared with test_sds_envoy


def mapped_files(pid: int) -> set[str]:
    paths = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            paths.add(fields[5])
    return paths


@pytest.mark.parametrize(
    "env",
    [{}, {"ECC_SIGNATURE_ALGORITHM": "ECDSA"}, {"PKCS8_KEY": "true"}],
    ids=["rsa", "ecdsa", "rsa-pkcs8"],
)
def test_a_running_agent_maps_no_cryptography(mesh, env: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    control_plane, workdir = mesh
    agent, envoy, _ = start_pair(control_plane, workdir, **env)
    try:
        secrets = wait_for_secrets(agent, envoy)
        from cryptography import x509

        leaf = leaf_from_secret(secrets["default"])
        sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [IDENTITY]
        assert agent.process is not None
        mapped = mapped_files(agent.process.pid)
        assert [p for p in mapped if "/cryptography/" in p or "_rust" in Path(p).name] == []
        libcrypto = [p for p in mapped if Path(p).name.startswith("libcrypto")]
        assert len(libcrypto) == 1, libcrypto
        assert any(Path(p).name.startswith("_ssl") for p in mapped)  # the ssl module that mapped it
    finally:
        assert agent.stop() == 0
