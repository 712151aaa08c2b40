"""A mesh of local workloads on loopback: what the demo, the benchmarks and the end-to-end tests run.

Each workload gets its own directory (the agent's well-known paths are relative to it, as in a pod),
the files Kubernetes would mount (the CA root config map and a projected token), free ports for
everything, and the environment ``pilot-agent proxy`` reads in a sidecar. The mesh file the local
control plane serves is written from the same descriptions, so ports always agree.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from istio_agent.controlplane.tokens import mint_token
from istio_agent.ctl.local import controlplane_command, free_port, port_open, wait_until
from istio_agent.files import write_atomic

ROOT_CERT_MOUNT = "var/run/secrets/istio/root-cert.pem"
TOKEN_MOUNT = "var/run/secrets/tokens/istio-token"


@dataclass(frozen=True)
class Service:
    name: str
    port: int = 8000
    namespace: str = "default"
    protocol: str = "http"

    @property
    def hostname(self) -> str:
        return f"{self.name}.{self.namespace}.svc.cluster.local"

    def mesh_entry(self) -> dict[str, Any]:
        return {"name": self.name, "namespace": self.namespace, "port": self.port, "protocol": self.protocol}


@dataclass
class Workload:
    """One pod: its identity, the services it backs and calls, and the ports picked for it."""

    name: str
    workdir: Path
    namespace: str = "default"
    service_account: str = ""
    backs: list[str] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.service_account = self.service_account or self.name
        for role in ("admin", "status", "envoy_status", "prometheus", "inbound", "app", "dns", "tap"):
            self.ports.setdefault(role, free_port())
        for service in self.calls:
            self.ports.setdefault(f"outbound:{service}", free_port())

    @property
    def spiffe_id(self) -> str:
        return f"spiffe://cluster.local/ns/{self.namespace}/sa/{self.service_account}"

    def outbound_port(self, service: str) -> int:
        return self.ports[f"outbound:{service}"]

    def mesh_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "name": self.name,
            "namespace": self.namespace,
            "serviceAccount": self.service_account,
            "address": "127.0.0.1",
            "labels": {"app": self.name},
        }
        if self.backs:
            entry.update(services=self.backs, inboundPort=self.ports["inbound"], appPort=self.ports["app"])
        if self.calls:
            entry["outbound"] = [{"service": s, "port": self.outbound_port(s)} for s in self.calls]
        return entry

    def prepare(self, state_dir: Path) -> None:
        """Lay out what Kubernetes would mount: the CA root config map and the projected token."""
        root = self.workdir / ROOT_CERT_MOUNT
        root.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(state_dir / "root-cert.pem", root)
        token = self.workdir / TOKEN_MOUNT
        token.parent.mkdir(parents=True, exist_ok=True)
        token.write_text(mint_token(state_dir, self.namespace, self.service_account))

    def env(self, discovery_address: str, *, delta: bool = True, **extra: str) -> dict[str, str]:
        """The sidecar environment (as the injector would set it) for ``pilot-agent proxy``."""
        proxy_config = {
            "discoveryAddress": discovery_address,
            "proxyAdminPort": self.ports["admin"],
            "statusPort": self.ports["status"],
            "terminationDrainDuration": "1s",
        }
        env = {
            "PATH": "/usr/bin:/bin",
            "POD_NAME": self.name,
            "POD_NAMESPACE": self.namespace,
            "SERVICE_ACCOUNT": self.service_account,
            "INSTANCE_IP": "127.0.0.1",
            "PROXY_CONFIG": json.dumps(proxy_config),
            "ENVOY_STATUS_PORT": str(self.ports["envoy_status"]),
            "ENVOY_PROMETHEUS_PORT": str(self.ports["prometheus"]),
            "ISTIO_DELTA_XDS": "true" if delta else "false",
            "ISTIO_META_DNS_CAPTURE": "true",
            "DNS_PROXY_ADDR": f"127.0.0.1:{self.ports['dns']}",  # not 15053: several workloads per host
            "PROXY_XDS_DEBUG_VIA_AGENT_PORT": str(self.ports["tap"]),  # not 15004, for the same reason
            "ECC_SIGNATURE_ALGORITHM": "ECDSA",
        }
        env.update(extra)
        return env

    def agent_command(self, *extra: str) -> list[str]:
        return [sys.executable, "-m", "istio_agent.cli.pilot_agent", "proxy", "sidecar", *extra]

    def app_command(self) -> list[str]:
        port = str(self.ports["app"])
        return [sys.executable, "-m", "istio_agent.ctl.echo", "--name", self.name, "--port", port]


def mesh_document(services: list[Service], workloads: list[Workload], **extra: Any) -> dict[str, Any]:
    return {
        "trustDomain": "cluster.local",
        "services": [service.mesh_entry() for service in services],
        "workloads": [workload.mesh_entry() for workload in workloads],
        **extra,
    }


def write_mesh(path: Path, services: list[Service], workloads: list[Workload], **extra: Any) -> None:
    """Write the mesh file atomically (the control plane watches it)."""
    write_atomic(path, yaml.safe_dump(mesh_document(services, workloads, **extra), sort_keys=False))


@dataclass
class Processes:
    """Child processes by name, stopped in reverse start order."""

    children: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    def start(self, name: str, args: list[str], log: Path, **kwargs: Any) -> subprocess.Popen[bytes]:
        with log.open("ab") as output:
            process = subprocess.Popen(args, stdout=output, stderr=subprocess.STDOUT, **kwargs)
        self.children[name] = process
        self.logs[name] = log
        return process

    def alive(self, *names: str) -> bool:
        """True while the named children (default: all) run; raises, naming the child, once one exited."""
        for name in names or tuple(self.children):
            process = self.children[name]
            if process.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with status {process.returncode}; last lines of its log:\n{self.log_tail(name)}"
                )
        return True

    def log_tail(self, name: str, lines: int = 15) -> str:
        try:
            return "\n".join(self.logs[name].read_text(errors="replace").splitlines()[-lines:])
        except (KeyError, OSError):
            return "(no log)"

    def stop(self, name: str, *, kill: bool = False, timeout: float = 15) -> int:
        process = self.children.pop(name)
        if process.poll() is None:
            process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return process.returncode

    def stop_all(self) -> dict[str, int]:
        return {name: self.stop(name) for name in reversed(list(self.children))}


def admin_json(port: int, path: str, timeout: float = 2) -> Any:
    """GET an Envoy admin path and decode its JSON."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
        return json.load(response)


def dynamic_names(admin_port: int) -> dict[str, list[str]]:
    """Names of the listeners, clusters and routes Envoy got over xDS (empty lists when unreachable)."""
    try:
        dump = admin_json(admin_port, "/config_dump")
    except OSError:
        return {"listeners": [], "clusters": [], "routes": []}
    names: dict[str, list[str]] = {"listeners": [], "clusters": [], "routes": []}
    for config in dump.get("configs", []):
        for entry in config.get("dynamic_listeners", []):
            names["listeners"].append(entry["name"])
        for entry in config.get("dynamic_active_clusters", []):
            names["clusters"].append(entry["cluster"]["name"])
        for entry in config.get("dynamic_route_configs", []):
            names["routes"].append(entry["route_config"]["name"])
    return {kind: sorted(values) for kind, values in names.items()}


class LocalMesh:
    """The local control plane plus workloads (echo app + pilot-agent + Envoy each) as processes."""

    def __init__(
        self,
        base: Path,
        services: list[Service],
        workloads: list[Workload],
        *,
        delta: bool = True,
        agent_env: dict[str, str] | None = None,
    ) -> None:
        self.base = base
        self.services, self.workloads = services, workloads
        self.delta = delta
        self.agent_env = agent_env or {}
        self.state_dir = base / "controlplane"
        self.mesh_file = base / "mesh.yaml"
        self.port, self.secure_port = free_port(), free_port()
        self.processes = Processes()
        write_mesh(self.mesh_file, services, workloads)

    @property
    def discovery_address(self) -> str:
        return f"127.0.0.1:{self.secure_port}"

    def workload(self, name: str) -> Workload:
        return next(w for w in self.workloads if w.name == name)

    def start_controlplane(self, timeout: float = 30) -> None:
        command = controlplane_command(self.mesh_file, self.state_dir, self.port, self.secure_port)
        self.processes.start("control plane", command, self.base / "controlplane.log")
        wait_until(
            lambda: self.processes.alive("control plane") and port_open(self.secure_port),
            timeout,
            "the control plane to listen",
        )

    def stop_controlplane(self, *, kill: bool = False) -> int:
        return self.processes.stop("control plane", kill=kill)

    def start_workload(self, workload: Workload) -> None:
        """Start the workload's app and its pilot-agent (which starts Envoy); returns without waiting."""
        workload.workdir.mkdir(parents=True, exist_ok=True)
        self.processes.start(f"app {workload.name}", workload.app_command(), workload.workdir / "app.log")
        self.start_agent(workload)

    def start_agent(self, workload: Workload, **extra_env: str) -> None:
        """Start the workload's pilot-agent alone (the app is the caller's: a proxyless one, say)."""
        workload.workdir.mkdir(parents=True, exist_ok=True)
        workload.prepare(self.state_dir)
        env = workload.env(self.discovery_address, delta=self.delta, **{**self.agent_env, **extra_env})
        self.processes.start(
            f"pilot-agent {workload.name}",
            workload.agent_command(),
            workload.workdir / "agent.log",
            cwd=workload.workdir,
            env=env,
        )

    def wait_for_config(
        self,
        workload: Workload,
        check: Callable[[dict[str, list[str]]], bool],
        what: str,
        timeout: float = 30,
    ) -> dict[str, list[str]]:
        """Wait until ``check`` accepts the names of the workload's Envoy's dynamic config."""
        seen: dict[str, list[str]] = {}

        def ready() -> bool:
            nonlocal seen
            self.processes.alive(f"pilot-agent {workload.name}")
            seen = dynamic_names(workload.ports["admin"])
            return check(seen)

        try:
            wait_until(ready, timeout, f"{workload.name}'s Envoy to get {what}")
        except TimeoutError as err:
            raise TimeoutError(f"{err}; it has {seen}") from None
        return seen

    def update_mesh(self, **extra: Any) -> None:
        write_mesh(self.mesh_file, self.services, self.workloads, **extra)

    def stop(self) -> dict[str, int]:
        return self.processes.stop_all()
