"""End-to-end: the local CA, ``pilot-agent proxy`` serving SDS, and a real Envoy terminating mTLS.

The agent and the control plane run as real processes; the agent starts Envoy on a static mTLS
bootstrap given as ProxyConfig ``customConfigFile``. Envoy's SDS cluster points at the agent's
socket (relative path, as Istio's bootstrap) and its listener uses ``default`` and ``ROOTCA``.
"""

from __future__ import annotations

import base64
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from istio_agent.controlplane.ca import LocalCA
from istio_agent.ctl.local import free_port, wait_until
from istio_agent.ctl.static_mtls import mtls_bootstrap
from istio_agent.security.keys import KeyOptions, generate_csr
from tests.e2e.harness import ControlPlane, Envoy, env_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NAMESPACE, SERVICE_ACCOUNT = "default", "httpbin"
IDENTITY = f"spiffe://cluster.local/ns/{NAMESPACE}/sa/{SERVICE_ACCOUNT}"
SDS_SOCKET = "./var/run/secrets/workload-spiffe-uds/socket"


class Agent:
    """``pilot-agent proxy`` as a subprocess in a workload directory."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir, self.env = workdir, env
        self.log_path = workdir / "agent.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "istio_agent.cli.pilot_agent", "proxy", "sidecar"],
            cwd=self.workdir,
            env=self.env,
            stdout=self.log_path.open("ab"),
            stderr=subprocess.STDOUT,
        )
        wait_until(lambda: self.alive() and (self.workdir / SDS_SOCKET).exists(), 20, "the SDS socket")

    def alive(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"agent exited {self.process.returncode}: {self.log_path.read_text()}")
        return True

    def stop(self) -> int:
        assert self.process is not None
        self.process.terminate()
        return self.process.wait(15)


def client_context(control_plane: ControlPlane, workdir: Path) -> ssl.SSLContext:
    """A TLS client with its own workload certificate from the same CA (a 'sleep' workload)."""
    csr, key = generate_csr(
        "spiffe://cluster.local/ns/default/sa/sleep", KeyOptions(ecc_signature_algorithm="ECDSA")
    )
    ca = LocalCA.load_or_create(control_plane.state_dir, "cluster.local")
    chain = ca.sign_csr(csr, "spiffe://cluster.local/ns/default/sa/sleep", timedelta(hours=1))
    (workdir / "client-chain.pem").write_text("".join(c if c.endswith("\n") else c + "\n" for c in chain))
    (workdir / "client-key.pem").write_bytes(key)
    context = ssl.create_default_context(cafile=str(control_plane.root_cert))
    context.check_hostname = False  # workload certificates carry a SPIFFE URI, no DNS name
    context.load_cert_chain(workdir / "client-chain.pem", workdir / "client-key.pem")
    return context


def handshake(context: ssl.SSLContext, port: int) -> tuple[int, str]:
    """mTLS handshake + one HTTP request; returns the server certificate serial and the response."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, context.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
        assert der is not None
        serial = x509.load_der_x509_certificate(der).serial_number
        tls.sendall(b"GET / HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        response = b""
        while chunk := tls.recv(4096):
            response += chunk
    return serial, response.decode(errors="replace")


def served_secrets(envoy: Envoy) -> dict[str, dict[str, Any]]:
    dump = envoy.admin_json("/config_dump?resource=dynamic_active_secrets")
    secrets = {}
    for config in dump.get("configs", []):
        secret = config.get("secret", {})
        secrets[secret.get("name", config.get("name"))] = secret
    return secrets


def leaf_from_secret(secret: dict[str, Any]) -> x509.Certificate:
    chain = base64.b64decode(secret["tls_certificate"]["certificate_chain"]["inline_bytes"])
    return x509.load_pem_x509_certificate(chain)


@pytest.fixture
def mesh(short_tmp: Path):  # type: ignore[no-untyped-def]
    control_plane = ControlPlane(short_tmp)
    control_plane.start()
    workdir = short_tmp / "httpbin"
    control_plane.prepare_workload(workdir, NAMESPACE, SERVICE_ACCOUNT)
    try:
        yield control_plane, workdir
    finally:
        control_plane.stop()


def start_pair(
    control_plane: ControlPlane, workdir: Path, delta_sds: bool = False, **env: str
) -> tuple[Agent, Envoy, int]:
    """The agent, which starts Envoy on our mTLS bootstrap (ProxyConfig customConfigFile, as Istio)."""
    admin_port, listener_port = free_port(), free_port()
    node = f"sidecar~127.0.0.1~{SERVICE_ACCOUNT}.{NAMESPACE}~{NAMESPACE}.svc.cluster.local"
    bootstrap = mtls_bootstrap(
        node, f"{SERVICE_ACCOUNT}.{NAMESPACE}", admin_port, listener_port, delta_sds=delta_sds
    )
    envoy = Envoy(workdir, bootstrap, admin_port)
    proxy_config = {"customConfigFile": envoy.bootstrap_path.name, "proxyAdminPort": admin_port}
    agent = Agent(
        workdir,
        env_for(
            CA_ADDR=f"127.0.0.1:{control_plane.secure_port}",
            POD_NAMESPACE=NAMESPACE,
            SERVICE_ACCOUNT=SERVICE_ACCOUNT,
            PROXY_CONFIG=json.dumps(proxy_config),
            **env,
        ),
    )
    agent.start()
    return agent, envoy, listener_port


def wait_for_secrets(agent: Agent, envoy: Envoy) -> dict[str, dict[str, Any]]:
    def ready() -> bool:
        agent.alive()
        try:
            secrets = served_secrets(envoy)
        except OSError:
            return False
        return "default" in secrets and "ROOTCA" in secrets

    wait_until(ready, 30, "Envoy to receive default and ROOTCA over SDS")
    return served_secrets(envoy)


@pytest.mark.parametrize("delta_sds", [False, True], ids=["sotw", "delta"])
def test_envoy_gets_workload_certificate_and_terminates_mtls(mesh, delta_sds: bool) -> None:  # type: ignore[no-untyped-def]
    control_plane, workdir = mesh
    agent, envoy, port = start_pair(control_plane, workdir, delta_sds, ECC_SIGNATURE_ALGORITHM="ECDSA")
    try:
        secrets = wait_for_secrets(agent, envoy)
        kind = "delta" if delta_sds else "sotw"
        assert f"SDS: new connection id=1 ({kind})" in agent.log_path.read_text()
        leaf = leaf_from_secret(secrets["default"])
        sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [IDENTITY]
        root = base64.b64decode(secrets["ROOTCA"]["validation_context"]["trusted_ca"]["inline_bytes"])
        assert x509.load_pem_x509_certificate(root) == x509.load_pem_x509_certificate(
            control_plane.root_cert.read_bytes()
        )
        # Envoy's own view of the certificate it serves.
        certs = envoy.admin_json("/certs")["certificates"]
        uris = [
            san.get("uri")
            for c in certs
            for cert in c.get("cert_chain", [])
            for san in cert["subject_alt_names"]
        ]
        assert IDENTITY in uris

        serial, response = handshake(client_context(control_plane, workdir), port)
        assert serial == leaf.serial_number
        assert response.startswith("HTTP/1.1 200")
        assert "hello from envoy" in response

        # A client without a certificate from the mesh CA is refused.
        anonymous = ssl.create_default_context(cafile=str(control_plane.root_cert))
        anonymous.check_hostname = False
        with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
            handshake(anonymous, port)
    finally:
        assert agent.stop() == 0


def test_rotation_reaches_envoy_without_failed_handshakes(mesh) -> None:  # type: ignore[no-untyped-def]
    control_plane, workdir = mesh
    agent, envoy, port = start_pair(control_plane, workdir, ECC_SIGNATURE_ALGORITHM="ECDSA", SECRET_TTL="4s")
    try:
        wait_for_secrets(agent, envoy)
        context = client_context(control_plane, workdir)
        serials: list[int] = []
        failures: list[str] = []
        stop = threading.Event()

        def hammer() -> None:
            while not stop.is_set():
                try:
                    serial, response = handshake(context, port)
                    if not response.startswith("HTTP/1.1 200"):
                        failures.append(response[:80])
                    if not serials or serials[-1] != serial:
                        serials.append(serial)
                except OSError as err:
                    failures.append(repr(err))
                time.sleep(0.1)

        worker = threading.Thread(target=hammer)
        worker.start()
        try:
            wait_until(lambda: len(serials) >= 3 or bool(failures), 20, "two rotations to reach Envoy")
        finally:
            stop.set()
            worker.join()
        assert failures == []
        assert len(set(serials)) >= 3
    finally:
        assert agent.stop() == 0
