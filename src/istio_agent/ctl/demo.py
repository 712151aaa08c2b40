"""``agentctl demo``: the local control plane, one workload's agent and a real Envoy, on loopback.

What it shows: ``pilot-agent proxy`` obtains the workload's SPIFFE certificate from the local CA
and serves it over SDS; Envoy terminates mTLS with it; a client with its own mesh certificate
calls Envoy and Envoy reports the caller identity it verified. Then everything stops cleanly.
(The two-workload mesh with xDS arrives with the xDS proxy.)
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography import x509

from istio_agent.bootstrap.sds import mtls_context, sds_cluster
from istio_agent.controlplane.ca import LocalCA
from istio_agent.controlplane.tokens import mint_token
from istio_agent.ctl.local import controlplane_command, free_port, port_open, wait_until
from istio_agent.envoy.binary import find_envoy
from istio_agent.security.keys import KeyOptions, generate_csr

SDS_SOCKET = "./var/run/secrets/workload-spiffe-uds/socket"
TRUST_DOMAIN = "cluster.local"


def mtls_bootstrap(
    node_id: str, cluster: str, admin_port: int, listener_port: int, *, delta_sds: bool = False
) -> dict[str, Any]:
    """Envoy with one mTLS listener (``default`` + ``ROOTCA`` over SDS) that echoes the verified caller."""
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inbound",
        "forward_client_cert_details": "SANITIZE_SET",
        "set_current_client_cert_details": {"uri": True},
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "direct_response": {
                                "status": 200,
                                "body": {"inline_string": "hello from envoy"},
                            },
                            "response_headers_to_add": [
                                {
                                    "header": {
                                        "key": "x-peer-identity",
                                        "value": "%DOWNSTREAM_PEER_URI_SAN%",
                                    },
                                }
                            ],
                        }
                    ],
                }
            ]
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        ],
    }
    return {
        "node": {"id": node_id, "cluster": cluster},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "clusters": [sds_cluster(SDS_SOCKET)],
            "listeners": [
                {
                    "name": "inbound-mtls",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listener_port}},
                    "filter_chains": [
                        {
                            "transport_socket": mtls_context(
                                downstream=True,
                                peer_spiffe_prefix=f"spiffe://{TRUST_DOMAIN}/",
                                delta=delta_sds,
                            ),
                            "filters": [
                                {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                            ],
                        }
                    ],
                }
            ],
        },
    }


@dataclass
class Processes:
    """Child processes, stopped in reverse start order."""

    children: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def start(self, name: str, args: list[str], log: Path, **kwargs: Any) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(args, stdout=log.open("ab"), stderr=subprocess.STDOUT, **kwargs)
        self.children.append((name, process))
        return process

    def alive(self) -> bool:
        """True while every child runs; raises, naming the child, once one has exited."""
        for name, process in self.children:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with status {process.returncode}")
        return True

    def stop(self) -> dict[str, int]:
        codes = {}
        for name, process in reversed(self.children):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            codes[name] = process.returncode
        return codes


def envoy_secrets(admin_port: int) -> dict[str, Any]:
    url = f"http://127.0.0.1:{admin_port}/config_dump?resource=dynamic_active_secrets"
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            dump = json.load(response)
    except OSError:
        return {}
    return {c["name"]: c for c in dump.get("configs", [])}


def run_demo(base: Path, keep: bool, echo: Callable[[str], None]) -> int:
    """Run the demo under ``base``; return the exit status."""
    processes = Processes()
    python = sys.executable
    namespace, workload, caller = "default", "httpbin", "sleep"
    state, mesh = base / "controlplane", base / "mesh.yaml"
    mesh.write_text(f"trustDomain: {TRUST_DOMAIN}\n")
    plain_port, tls_port = free_port(), free_port()
    admin_port, listener_port = free_port(), free_port()
    try:
        echo(f"[1/5] starting the local control plane (CA) on 127.0.0.1:{tls_port} ...")
        processes.start(
            "control plane",
            controlplane_command(mesh, state, plain_port, tls_port),
            base / "controlplane.log",
        )
        wait_until(lambda: processes.alive() and port_open(tls_port), 30, "the control plane")

        echo(f"[2/5] starting pilot-agent for {workload}.{namespace} (SDS on {SDS_SOCKET}) ...")
        workdir = base / workload
        (workdir / "var/run/secrets/istio").mkdir(parents=True)
        shutil.copy(state / "root-cert.pem", workdir / "var/run/secrets/istio/root-cert.pem")
        (workdir / "var/run/secrets/tokens").mkdir(parents=True)
        (workdir / "var/run/secrets/tokens/istio-token").write_text(mint_token(state, namespace, workload))
        env = {
            "PATH": "/usr/bin:/bin",
            "CA_ADDR": f"127.0.0.1:{tls_port}",
            "POD_NAMESPACE": namespace,
            "SERVICE_ACCOUNT": workload,
            "ECC_SIGNATURE_ALGORITHM": "ECDSA",
        }
        processes.start(
            "pilot-agent",
            [python, "-m", "istio_agent.cli.pilot_agent", "proxy", "sidecar"],
            workdir / "agent.log",
            cwd=workdir,
            env=env,
        )
        wait_until(lambda: processes.alive() and (workdir / SDS_SOCKET).exists(), 30, "the SDS socket")

        echo(
            f"[3/5] starting Envoy (admin 127.0.0.1:{admin_port}, mTLS listener 127.0.0.1:{listener_port}) ..."
        )
        bootstrap = mtls_bootstrap(
            f"sidecar~127.0.0.1~{workload}.{namespace}~{namespace}.svc.cluster.local",
            f"{workload}.{namespace}",
            admin_port,
            listener_port,
        )
        (workdir / "envoy.json").write_text(json.dumps(bootstrap, indent=1))
        processes.start(
            "envoy",
            [str(find_envoy()), "-c", "envoy.json", "--use-dynamic-base-id", "--log-level", "warning"],
            workdir / "envoy.log",
            cwd=workdir,
        )
        wait_until(
            lambda: processes.alive() and {"default", "ROOTCA"} <= envoy_secrets(admin_port).keys(),
            30,
            "Envoy to receive its certificates over SDS",
        )

        echo(f"[4/5] calling Envoy over mTLS as spiffe://{TRUST_DOMAIN}/ns/{namespace}/sa/{caller} ...")
        served, headers, body = call_with_mesh_identity(state, namespace, caller, workdir, listener_port)

        echo("[5/5] results\n")
        rows = [
            ("workload identity (Envoy's certificate)", ", ".join(_uris(served))),
            ("certificate serial", f"{served.serial_number:x}"),
            (
                "certificate expires",
                f"{served.not_valid_after_utc:%Y-%m-%d %H:%M:%S} UTC "
                f"(in {_hours(served.not_valid_after_utc)})",
            ),
            ("issuer", served.issuer.rfc4514_string() or "(empty)"),
            ("secrets in Envoy", ", ".join(sorted(envoy_secrets(admin_port)))),
            ("response from Envoy", f"{headers.get('status')} {body!r}"),
            ("caller identity Envoy verified", headers.get("x-peer-identity", "(none)")),
        ]
        width = max(len(label) for label, _ in rows)
        for label, value in rows:
            echo(f"  {label:<{width}}  {value}")
        echo("")
        if keep:
            pids = " ".join(str(p.pid) for _, p in processes.children)
            echo(f"left running in {base}; stop with: kill {pids}")
            processes.children.clear()
            return 0
        return 0
    finally:
        if processes.children:
            codes = processes.stop()
            echo("stopped: " + ", ".join(f"{name} (exit {code})" for name, code in codes.items()))


def call_with_mesh_identity(
    state: Path, namespace: str, caller: str, workdir: Path, port: int
) -> tuple[x509.Certificate, dict[str, str], str]:
    """An mTLS request with a certificate for ``caller`` from the same CA; returns Envoy's cert and the response."""
    identity = f"spiffe://{TRUST_DOMAIN}/ns/{namespace}/sa/{caller}"
    csr, key = generate_csr(identity, KeyOptions(ecc_signature_algorithm="ECDSA"))
    chain = LocalCA.load_or_create(state, TRUST_DOMAIN).sign_csr(csr, identity, timedelta(hours=1))
    (workdir / "caller-chain.pem").write_text("".join(chain))
    (workdir / "caller-key.pem").write_bytes(key)
    context = ssl.create_default_context(cafile=str(state / "root-cert.pem"))
    context.check_hostname = False  # workload certificates carry a SPIFFE URI, not a DNS name
    context.load_cert_chain(workdir / "caller-chain.pem", workdir / "caller-key.pem")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, context.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
        tls.sendall(b"GET / HTTP/1.1\r\nHost: httpbin\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := tls.recv(4096):
            data += chunk
    assert der is not None
    head, _, body = data.decode(errors="replace").partition("\r\n\r\n")
    lines = head.split("\r\n")
    headers = {"status": lines[0].partition(" ")[2]}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return x509.load_der_x509_certificate(der), headers, body


def _uris(cert: x509.Certificate) -> list[str]:
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(uri) for uri in sans.get_values_for_type(x509.UniformResourceIdentifier)]


def _hours(when: datetime) -> str:
    left = when - datetime.now(UTC)
    return f"{left.total_seconds() / 3600:.1f} h"


def demo(keep: bool, echo: Callable[[str], None]) -> int:
    base = Path(tempfile.mkdtemp(prefix="istio-agent-demo-", dir="/tmp"))
    try:
        return run_demo(base, keep, echo)
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
