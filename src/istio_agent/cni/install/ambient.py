"""install-cni's ambient node agent: built from its settings, on the API server of the plugin's kubeconfig.

Istio's ``cni/pkg/cmd/root.go`` starts the node agent (``nodeagent.NewServer``, ``Start``) before the
installer writes the plugin's config, so ambient pods the plugin forwards find it listening; its
readiness joins the installer's in ``/readyz``. On shutdown the agent stops; the host's probe rules
are taken out only with ``AMBIENT_DISABLE_SAFE_UPGRADE`` (see docs/compatibility.md: Istio also
asks the API whether its DaemonSet is still there, an upgrade, and keeps them then).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from istio_agent.config.env import ConfigError

if TYPE_CHECKING:
    from istio_agent.cni.ambient.nodeagent import NodeAgent
    from istio_agent.cni.install.settings import InstallSettings
    from istio_agent.metrics import Registry


class AmbientSetupError(Exception):
    """The node agent cannot be built (its API client); install-cni exits, as Istio's does."""


def build_node_agent(settings: InstallSettings, registry: Registry) -> NodeAgent | None:
    """The node agent for ``settings`` (None when ambient is off); AmbientSetupError."""
    if settings.ambient is None:
        return None
    from istio_agent.cni.ambient.nodeagent import build
    from istio_agent.cni.install import kubeconfig
    from istio_agent.cni.kube import KubeClient, parse_kubeconfig

    try:
        config = parse_kubeconfig(kubeconfig.render(kubeconfig.build(settings)), "of the service account")
    except (kubeconfig.KubeconfigError, ConfigError) as err:
        raise AmbientSetupError(f"error initializing kube client for the ambient node agent: {err}") from None
    client = KubeClient(
        config._replace(token="", token_file=settings.service_account_dir / "token"), user_agent="install-cni"
    )
    return build(settings.ambient, client, socket_dir=settings.cni_agent_run_dir, registry=registry)
