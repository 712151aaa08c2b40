"""CNI_ARGS: the pod's name, namespace and ids that the Kubernetes runtime passes as ``K=V;K=V``.

Parsed as the CNI library's ``LoadArgs`` parses it into Istio's ``K8sArgs``: every pair must split
into exactly two parts on ``=``, and a key the plugin does not know is an error unless the runtime
sets ``IgnoreUnknown`` to a true value (containerd and CRI-O always do).
"""

from __future__ import annotations

from typing import NamedTuple

AGENT_POD_PREFIX = "istio-cni-node-"


class ArgsError(ValueError):
    """CNI_ARGS does not parse; the message names the pair or key."""


class K8sArgs(NamedTuple):
    """The pod's identity (NamedTuple, not a dataclass: cheaper to define, and the plugin defines it
    on every ADD)."""

    pod_name: str = ""
    pod_namespace: str = ""
    infra_container_id: str = ""
    pod_uid: str = ""


_KEYS = {
    "K8S_POD_NAME": "pod_name",
    "K8S_POD_NAMESPACE": "pod_namespace",
    "K8S_POD_INFRA_CONTAINER_ID": "infra_container_id",
    "K8S_POD_UID": "pod_uid",
}


def _unmarshal_bool(value: str) -> bool:
    """The library's ``UnmarshallableBool``: 1/true or 0/false, any case."""
    lowered = value.lower()
    if lowered in ("1", "true"):
        return True
    if lowered in ("0", "false"):
        return False
    raise ArgsError(f"ARGS: boolean unmarshal error: invalid input {value}")


def parse_k8s_args(raw: str) -> K8sArgs:
    """The pod's identity from CNI_ARGS; raises ArgsError."""
    if raw == "":
        return K8sArgs()
    pairs: list[tuple[str, str]] = []
    for pair in raw.split(";"):
        parts = pair.split("=")
        if len(parts) != 2:
            raise ArgsError(f"ARGS: invalid pair {pair!r}")
        pairs.append((parts[0], parts[1]))
    ignore_unknown = False
    for key, value in pairs:
        if key == "IgnoreUnknown":
            ignore_unknown = _unmarshal_bool(value)
    values: dict[str, str] = {}
    for key, value in pairs:
        if key == "IgnoreUnknown":
            continue
        field = _KEYS.get(key)
        if field is None:
            if ignore_unknown:
                continue
            raise ArgsError(f"ARGS: unknown args {key!r}")
        values[field] = value
    return K8sArgs(**values)


def is_agent_pod(args: K8sArgs, agent_namespace: str) -> bool:
    """The node agent's own pod: its sandbox must come up without the agent (which is not running yet)."""
    return args.pod_name.startswith(AGENT_POD_PREFIX) and args.pod_namespace == agent_namespace
