"""A node's directories in a temp dir, and install-cni settings pointing at them (no root needed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import IO

from istio_agent.cni.install.settings import InstallSettings
from istio_agent.cni.plugin_config import PluginConfig

DATA = Path(__file__).parent / "data"
GOLDEN = Path(__file__).parent / "golden"
PLUGIN = PluginConfig(
    plugin_log_level="debug",
    cni_agent_run_dir="/var/run/istio-cni",
    exclude_namespaces=("kube-system", "istio-system"),
    pod_namespace="istio-system",
)
TOKEN = "eyJhbGciOiJSUzI1NiJ9.secret-token-value"


class Node:
    """conf dir ``net.d``, plugin source ``src`` (an ``istio-cni`` file), target ``bin``, ``run``, service account ``sa``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "net.d"
        self.source = root / "src"
        self.bin = root / "bin"
        self.run = root / "run"
        self.sa = root / "sa"
        for directory in (self.conf, self.source, self.bin, self.sa):
            directory.mkdir()
        plugin = self.source / "istio-cni"
        plugin.write_text("#!/bin/sh\necho istio-cni\n")
        plugin.chmod(0o755)
        (self.sa / "token").write_text(TOKEN + "\n")
        (self.sa / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")

    def settings(self, **changes: object) -> InstallSettings:
        base = InstallSettings(
            mounted_cni_net_dir=self.conf,
            cni_agent_run_dir=self.run,
            cni_bin_source_dir=self.source,
            cni_bin_target_dirs=(self.bin,),
            service_account_dir=self.sa,
            kubernetes_service_host="10.96.0.1",
            kubernetes_service_port="443",
            plugin=PLUGIN,
        )
        return replace(base, **changes)  # type: ignore[arg-type]

    def put(self, data_name: str, as_name: str | None = None, mode: int = 0o644) -> Path:
        """Copy an input file from ``data/`` into the conf dir."""
        path = self.conf / (as_name or data_name)
        shutil.copyfile(DATA / data_name, path)
        path.chmod(mode)
        return path


def golden(name: str, actual: bytes) -> None:
    """Compare with ``golden/<name>``, written by hand from Istio's outputs (golden/README.md): never
    from ours, so nothing here writes it."""
    assert actual.decode() == (GOLDEN / name).read_text(), f"differs from golden {name}"


INSTALL_CNI = Path(sys.executable).parent / "install-cni"


def install_cni_args(node: Node, *, health_port: int = 0, program: Path = INSTALL_CNI) -> list[str]:
    """The install-cni command line on ``node``'s directories; no metrics listener. ``program``: this
    checkout's install-cni, or another's (an image's)."""
    return [
        str(program),
        f"--cni-agent-run-dir={node.run}",
        f"--mounted-cni-net-dir={node.conf}",
        f"--cni-bin-source-dir={node.source}",
        f"--cni-bin-target-dirs={node.bin}",
        f"--service-account-dir={node.sa}",
        f"--health-port={health_port}",
        "--monitoring-port=0",
    ]


def start_install_cni(
    node: Node,
    api_port: int,
    ca_pem: bytes,
    token: str,
    output: int | IO[bytes],
    *,
    netns: Path | None = None,
) -> subprocess.Popen[bytes]:
    """The real install-cni process on ``node``'s directories, its kubeconfig pointing at an API
    server on 127.0.0.1:``api_port`` (a fake one: the service account's CA and token are written
    here); no health or metrics listener. stdout and stderr go to ``output``. ``netns``: run it in
    that network namespace (a test's node), as the DaemonSet runs it in the host's."""
    (node.sa / "ca.crt").write_bytes(ca_pem)
    (node.sa / "token").write_text(token)
    env = {**os.environ, "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api_port)}
    args = install_cni_args(node)
    if netns is not None:
        args = ["nsenter", f"--net={netns}", "--", *args]
    return subprocess.Popen(args, env=env, stdout=output, stderr=subprocess.STDOUT)
