"""The ambient node agent install-cni runs when ``AMBIENT_ENABLED`` is set (Istio's ``nodeagent.Server``).

Istio's ``cni/pkg/nodeagent/server.go`` and ``cni/pkg/cmd/root.go``: the host's probe rules go in,
the pod and namespace caches are filled (:mod:`.enrollment`), the pods already enrolled are taken
back without being touched (their namespaces found in ``/proc``; with
``AMBIENT_RECONCILE_POD_RULES_ON_STARTUP`` their rules applied again, which leaves rules already
right as they are), then changes are reconciled, the ZDS server listens for ztunnel and the event
server for the plugin. The agent is *ready* from then on (install-cni's ``/readyz`` is 200 only
when both the install and the agent are): as in Istio, ztunnel being connected or not does not
change readiness (a pod started meanwhile fails its ADD, or waits ``pending``, until ztunnel comes).

Stopping for an upgrade leaves the host rules in place (Istio keeps the plugin and rules so new pods
stall until the next agent); stopping for good takes them out.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from istio_agent.cni.ambient.dataplane import Dataplane, HostProbes, InpodRules, KubeAnnotator, Ztunnel
from istio_agent.cni.ambient.enrollment import Enrollment
from istio_agent.cni.ambient.events import SOCKET_NAME, EventServer, reconcile_add_event
from istio_agent.cni.ambient.selectors import EnablementSelector
from istio_agent.cni.ambient.settings import InpodSettings, PodRedirect
from istio_agent.cni.kube import KubeClient
from istio_agent.log import scope
from istio_agent.metrics import Registry

log = scope("cni-agent")


@dataclass(frozen=True)
class AmbientSettings:
    """What the node agent runs on (Istio's ``AmbientArgs``), read by install-cni's settings."""

    selectors: tuple[EnablementSelector, ...]
    ztunnel_socket: Path = Path("/var/run/ztunnel/ztunnel.sock")
    node_name: str = ""
    system_namespace: str = "istio-system"
    inpod: InpodSettings = field(default_factory=InpodSettings)
    host_proc_dir: Path = Path("/host/proc")
    switch_to_host_netns: bool = False
    """``ALLOW_SWITCH_TO_HOST_NS`` (the chart sets it unless the DaemonSet shares the node's network):
    the node's probe rules and sets are made in the node's namespace, ``<host_proc_dir>/1/ns/net``
    (Istio's ``RunAsHost``), not in install-cni's own."""

    @property
    def host_netns(self) -> Path | None:
        """Where the node-side work runs: None is install-cni's own namespace (the node's, with hostNetwork)."""
        return self.host_proc_dir / "1" / "ns" / "net" if self.switch_to_host_netns else None


class ModuleRules:
    """The in-pod rules of :mod:`.inpod` with the node's settings (the dataplane's rules seam); the
    iptables flavour is detected at the first pod and kept (``inpod.with_backend``)."""

    def __init__(self, settings: InpodSettings) -> None:
        self.settings = settings

    def apply(self, netns: Path, pod: PodRedirect) -> None:
        from istio_agent.cni.ambient.inpod import apply_inpod, with_backend

        self.settings = with_backend(self.settings)
        apply_inpod(netns, self.settings, pod)

    def remove(self, netns: Path) -> None:
        from istio_agent.cni.ambient.inpod import remove_inpod, with_backend

        self.settings = with_backend(self.settings)
        remove_inpod(netns, self.settings)


class NodeAgent:
    """The caches, the dataplane, the ZDS server and the event server, started and stopped together."""

    def __init__(
        self,
        *,
        enrollment: Enrollment,
        dataplane: Dataplane,
        socket_path: Path,
        registry: Registry,
    ) -> None:
        self.enrollment = enrollment
        self.dataplane = dataplane
        self.events = EventServer(
            socket_path,
            lambda event: reconcile_add_event(event, enrollment.get_pod_if_ambient, dataplane),
            registry,
        )
        self.ready = False
        """Istio's ``watchServerReady``: the caches are synced and the servers listen."""

    @property
    def reason(self) -> str:
        return "" if self.ready else "the ambient node agent is starting"

    async def start(self) -> None:
        """Everything up (see the module); OSError when a socket cannot be had."""
        log.info("CNI ambient server starting")
        await self.enrollment.sync()
        log.info("CNI ambient server kubeclient started")
        await self.dataplane.initial_snapshot(self.enrollment.active_ambient_pods())
        self.enrollment.start_queue()
        await self.dataplane.start()
        await self.events.start()
        log.info("CNI ambient server marking ready")
        self.ready = True

    async def stop(self, *, cleanup: bool) -> None:
        """Stop serving; ``cleanup`` (not an upgrade) also takes the host rules out."""
        self.ready = False
        await self.events.stop()
        await self.enrollment.stop()
        await self.dataplane.stop(cleanup=cleanup)


def build(
    settings: AmbientSettings,
    client: KubeClient,
    *,
    socket_dir: Path,
    registry: Registry,
    rules: InpodRules | None = None,
    probes: HostProbes | None = None,
    ztunnel: Ztunnel | None = None,
    informer_options: dict[str, Any] | None = None,
) -> NodeAgent:
    """The node agent on its real parts; ``rules``, ``probes`` and ``ztunnel`` replace them (tests)."""
    from functools import partial

    from istio_agent.cni.ambient.procnetns import find_pod_netns

    dataplane_box: list[Dataplane] = []
    if ztunnel is None:
        from istio_agent.cni.ambient.zds import ZtunnelServer

        ztunnel = ZtunnelServer(settings.ztunnel_socket, snapshot=lambda: dataplane_box[0].snapshot())
    if probes is None:
        from istio_agent.cni.ambient.hostprobe import HostProbeRules

        probes = HostProbeRules(settings.inpod, netns=settings.host_netns, proc=settings.host_proc_dir)
    dataplane = Dataplane(
        rules=rules or ModuleRules(settings.inpod),
        probes=probes,
        ztunnel=ztunnel,
        annotate=KubeAnnotator(client),
        find_netns=partial(find_pod_netns, proc=settings.host_proc_dir),
        reconcile=settings.inpod.reconcile,
        host_root=settings.host_proc_dir.parent,  # /host/proc: the node's root is /host
    )
    dataplane_box.append(dataplane)
    enrollment = Enrollment(
        client,
        dataplane,
        settings.selectors,
        node_name=settings.node_name,
        system_namespace=settings.system_namespace,
        informer_options=informer_options,
        registry=registry,
    )
    return NodeAgent(
        enrollment=enrollment, dataplane=dataplane, socket_path=socket_dir / SOCKET_NAME, registry=registry
    )


async def wait_ready(agent: NodeAgent, timeout: float) -> None:
    """Until the agent is ready (tests and install-cni's start-up log)."""
    async with asyncio.timeout(timeout):
        while not agent.ready:
            await asyncio.sleep(0.01)
