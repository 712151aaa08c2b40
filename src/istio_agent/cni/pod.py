"""What a pod object says to the plugin: its containers, metadata, istio-proxy's env, and whether the
plugin leaves it alone (Istio's skip rules, ``cni/pkg/plugin/plugin.go``).

Apart from :mod:`istio_agent.cni.redirect` (the capture settings a pod asks for) so that a pod the
plugin skips, the common case on a node, costs no import of the rule-set settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from istio_agent.config.env import parse_go_bool
from istio_agent.logline import Scope

PROXY_CONTAINER = "istio-proxy"
INIT_CONTAINER = "istio-init"
STATUS_ANNOTATION = "sidecar.istio.io/status"
INJECT = "sidecar.istio.io/inject"

log = Scope("cni-plugin")


def containers(pod: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    spec = pod.get("spec") or {}
    return [c for c in spec.get(key) or () if isinstance(c, dict)]


def metadata(pod: Mapping[str, Any], key: str) -> Mapping[str, str]:
    """The pod's ``labels`` or ``annotations`` ({} when absent or not a map)."""
    values = (pod.get("metadata") or {}).get(key) or {}
    return values if isinstance(values, dict) else {}


def proxy_container(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The istio-proxy container: a regular one, or a native sidecar among the init containers."""
    for container in (*containers(pod, "initContainers"), *containers(pod, "containers")):
        if container.get("name") == PROXY_CONTAINER:
            return container
    return None


def env_value(container: Mapping[str, Any], name: str) -> str | None:
    """An env value given literally (``valueFrom`` reads as ""); of duplicates the last wins, as in Istio."""
    found = None
    for item in container.get("env") or ():
        if isinstance(item, dict) and item.get("name") == name:
            value = item.get("value")
            found = value if isinstance(value, str) else ""
    return found


def env_flag(container: Mapping[str, Any], name: str) -> bool:
    """A boolean env of istio-proxy; a bad value counts as false with a warning, as in Istio."""
    raw = env_value(container, name)
    if raw is None or raw == "":
        return False
    try:
        return parse_go_bool(raw)
    except ValueError:
        log.warning("ignoring %s=%r of container %s: not a boolean", name, raw, PROXY_CONTAINER)
        return False


def has_init_container(pod: Mapping[str, Any]) -> bool:
    """Whether the pod has an istio-init container (init or regular, as Istio looks), which writes
    the pod's rules itself."""
    every = (*containers(pod, "initContainers"), *containers(pod, "containers"))
    return any(c.get("name") == INIT_CONTAINER for c in every)


def skip_reason(pod: Mapping[str, Any]) -> str | None:
    """Why the pod gets no rules from the plugin (Istio's order), or None when it needs them."""
    if has_init_container(pod):
        return f"the pod has an {INIT_CONTAINER} container, which sets up its rules itself"
    proxy = proxy_container(pod)
    if proxy is not None and env_flag(proxy, "DISABLE_ENVOY"):
        return f"{PROXY_CONTAINER} has DISABLE_ENVOY set"
    if proxy is None:
        return f"the pod has no {PROXY_CONTAINER} container"
    args = proxy.get("args") or []
    if len(args) >= 2 and args[0] == "proxy" and args[1] != "sidecar":
        return f"{PROXY_CONTAINER} runs as {args[1]!r}, not as a sidecar"
    inject = metadata(pod, "labels").get(INJECT)
    if inject is None:
        inject = metadata(pod, "annotations").get(INJECT)
    if isinstance(inject, str):
        try:
            if not parse_go_bool(inject):
                return f"{INJECT} is {inject!r}"
        except ValueError:
            pass  # an unparseable value is ignored, as in Istio
    if STATUS_ANNOTATION not in metadata(pod, "annotations"):
        return f"the pod has no {STATUS_ANNOTATION} annotation (not injected)"
    return None
