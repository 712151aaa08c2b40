"""install-cni's ambient node agent: built from its settings, on the API server of the plugin's kubeconfig.

Istio's ``cni/pkg/cmd/root.go`` starts the node agent (``nodeagent.NewServer``, ``Start``) before the
installer writes the plugin's config, so ambient pods the plugin forwards find it listening; its
readiness joins the installer's in ``/readyz``.

When it stops, Istio asks whether this is an upgrade (``ShouldStopCleanup``): while install-cni's own
DaemonSet (``istio-cni-node`` in ``POD_NAMESPACE``) is still there and not being deleted, a new agent
is coming, so the plugin stays installed (new ambient pods fail their ADD until the new agent takes
them) and the host's probe rules stay for the pods already running. A DaemonSet gone, being deleted,
or a 401 (the uninstall took the service account's rights) is an uninstall: both go.
``AMBIENT_DISABLE_SAFE_UPGRADE`` always cleans up. Other errors are tried again (twice more with an
Istio-owned CNI config, where the answer then defaults to an upgrade) and default to an uninstall.
Istio also checks the DaemonSet's node affinity against this node; that is not done here (see
docs/compatibility.md).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from istio_agent.cni.kube import KubeClient, KubeError
from istio_agent.config.env import ConfigError
from istio_agent.log import scope

if TYPE_CHECKING:
    from istio_agent.cni.ambient.nodeagent import NodeAgent
    from istio_agent.cni.install.settings import InstallSettings
    from istio_agent.metrics import Registry

log = scope("cni-agent")

DAEMONSET = "istio-cni-node"
"""Istio's ``fmt.Sprintf("%s-node", "istio-cni")``."""
CHECK_SECONDS = 5.0
RETRY_INTERVAL = 1.0
"""Istio's ``tokenWaitBackoff`` between the attempts of the upgrade check."""


class AmbientSetupError(Exception):
    """The node agent cannot be built (its API client); install-cni exits, as Istio's does."""


class AmbientAgent:
    """The node agent as install-cni runs it: started, asked whether a stop is an upgrade, stopped."""

    def __init__(
        self,
        agent: NodeAgent,
        client: KubeClient,
        settings: InstallSettings,
        *,
        retry_interval: float = RETRY_INTERVAL,
    ) -> None:
        self.agent = agent
        self.client = client
        self.settings = settings
        self.retry_interval = retry_interval

    @property
    def ready(self) -> bool:
        return self.agent.ready

    @property
    def reason(self) -> str:
        return self.agent.reason

    async def start(self) -> None:
        await self.agent.start()

    async def stop(self, *, cleanup: bool) -> None:
        await self.agent.stop(cleanup=cleanup)

    async def is_upgrade(self) -> bool:
        """Istio's ``ShouldStopCleanup`` (see the module)."""
        if self.settings.ambient_disable_safe_upgrade:
            log.info("Ambient node agent safe upgrade explicitly disabled via env")
            return False
        namespace = self.settings.plugin.pod_namespace
        owned = self.settings.istio_owned_cni_config
        attempts = 3 if owned else 1
        for attempt in range(1, attempts + 1):
            try:
                daemonset = await self.client.get_daemonset(
                    namespace, DAEMONSET, deadline=time.monotonic() + CHECK_SECONDS
                )
            except KubeError as err:
                if err.status == 404:
                    log.info(
                        "parent DaemonSet %s is not found, this is not an upgrade, shutting down normally",
                        DAEMONSET,
                    )
                    return False
                if err.status == 401:
                    log.info(
                        "permission to get parent DaemonSet %s has been revoked, this is not an upgrade, "
                        "shutting down normally",
                        DAEMONSET,
                    )
                    return False
                log.info("failed to get parent DaemonSet %s: %s", DAEMONSET, err)
                if attempt < attempts:
                    await asyncio.sleep(self.retry_interval)
                continue
            meta = daemonset.get("metadata") or {}
            if meta.get("deletionTimestamp"):
                log.info("parent DaemonSet %s is marked for deletion, this is not an upgrade", DAEMONSET)
                return False
            log.info(
                "terminating, but parent DaemonSet %s is still present, this is an upgrade or a node reboot, "
                "leaving plugin in place",
                DAEMONSET,
            )
            return True
        log.info("could not tell whether this is an upgrade; taken as %s", "one" if owned else "not one")
        return owned


def build_node_agent(settings: InstallSettings, registry: Registry) -> AmbientAgent | None:
    """The node agent for ``settings`` (None when ambient is off); AmbientSetupError."""
    if settings.ambient is None:
        return None
    from istio_agent.cni.ambient.nodeagent import build
    from istio_agent.cni.install import kubeconfig
    from istio_agent.cni.kube import parse_kubeconfig

    try:
        config = parse_kubeconfig(kubeconfig.render(kubeconfig.build(settings)), "of the service account")
    except (kubeconfig.KubeconfigError, ConfigError) as err:
        raise AmbientSetupError(f"error initializing kube client for the ambient node agent: {err}") from None
    client = KubeClient(
        config._replace(token="", token_file=settings.service_account_dir / "token"), user_agent="install-cni"
    )
    agent = build(settings.ambient, client, socket_dir=settings.cni_agent_run_dir, registry=registry)
    return AmbientAgent(agent, client, settings)
