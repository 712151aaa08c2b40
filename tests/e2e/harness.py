"""Helpers for end-to-end tests: the local control plane as a real process, Envoy bootstraps and admin.

Everything listens on 127.0.0.1 with ports picked free at test time, and each workload runs in its
own directory (the agent's well-known paths are relative to it, as in Istio).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from istio_agent.ctl.local import controlplane_command, free_port, port_open, wait_until

REPO = Path(__file__).resolve().parents[2]


def agentctl(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "istio_agent.cli.agentctl", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"agentctl {' '.join(args)} failed: {done.stderr}")
    return done.stdout


class ControlPlane:
    """``agentctl controlplane`` as a subprocess."""

    def __init__(self, base: Path, trust_domain: str = "cluster.local") -> None:
        self.state_dir = base / "state"
        self.mesh_file = base / "mesh.yaml"
        self.mesh_file.write_text(f"trustDomain: {trust_domain}\n")
        self.port = free_port()
        self.secure_port = free_port()
        self.log_path = base / "controlplane.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def root_cert(self) -> Path:
        return self.state_dir / "root-cert.pem"

    def start(self) -> None:
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            controlplane_command(self.mesh_file, self.state_dir, self.port, self.secure_port),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        wait_until(
            lambda: self._alive() and port_open(self.port) and port_open(self.secure_port),
            20,
            "the control plane to listen",
        )

    def _alive(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"control plane exited: {self.log_path.read_text()}")
        return True

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def token(self, namespace: str, service_account: str) -> str:
        return agentctl(
            "token",
            "--state-dir",
            str(self.state_dir),
            "--namespace",
            namespace,
            "--service-account",
            service_account,
        ).strip()

    def prepare_workload(self, workdir: Path, namespace: str, service_account: str) -> None:
        """Lay out what Kubernetes would mount: the CA root config map and the projected token."""
        (workdir / "var/run/secrets/istio").mkdir(parents=True, exist_ok=True)
        shutil.copy(self.root_cert, workdir / "var/run/secrets/istio/root-cert.pem")
        (workdir / "var/run/secrets/tokens").mkdir(parents=True, exist_ok=True)
        (workdir / "var/run/secrets/tokens/istio-token").write_text(self.token(namespace, service_account))


class Envoy:
    """An Envoy bootstrap written into a workload directory (the agent starts Envoy on it) and its admin API."""

    def __init__(self, workdir: Path, bootstrap: dict[str, Any], admin_port: int) -> None:
        self.workdir = workdir
        self.admin_port = admin_port
        self.bootstrap_path = workdir / "envoy-bootstrap.json"
        self.bootstrap_path.write_text(json.dumps(bootstrap, indent=2))

    def admin(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}{path}", timeout=5) as response:
            return str(response.read().decode())

    def admin_json(self, path: str) -> Any:
        return json.loads(self.admin(path))


def env_for(**extra: str) -> dict[str, str]:
    """A clean environment mapping for an agent (no inherited Istio variables)."""
    base = {key: value for key, value in os.environ.items() if key in ("PATH", "HOME")}
    base.update(extra)
    return base
