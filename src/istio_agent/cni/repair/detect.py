"""Whether a pod is broken the way the repair controller fixes: Istio's ``matchesFilter``.

``cni/pkg/repair/repaircontroller.go``: a pod carrying the sidecar annotation (when one is set)
whose init container of the configured name last terminated with the configured exit code and
termination message (each ignored when unset: 0 and ""), and whose *current* state is not a
successful exit. Fields are read as the kubelet reports them (``status.initContainerStatuses[].state``
and ``.lastState``, Go's ``LastTerminationState``); anything missing counts as Go's zero value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from istio_agent.cni.install.settings import RepairSettings


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _exit_code(terminated: Mapping[str, Any]) -> int:
    code = terminated.get("exitCode", 0)
    return code if isinstance(code, int) and not isinstance(code, bool) else 0


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def is_broken(pod: Mapping[str, Any], settings: RepairSettings) -> bool:
    """True when ``pod`` matches the repair filter (only then is anything done to it)."""
    if settings.sidecar_annotation:
        annotations = _map(_map(pod.get("metadata")).get("annotations"))
        if settings.sidecar_annotation not in annotations:
            return False
    wanted_message = settings.init_termination_message.strip()
    statuses = _map(pod.get("status")).get("initContainerStatuses")
    for status in statuses if isinstance(statuses, list) else ():
        status = _map(status)
        if settings.init_container_name and status.get("name") != settings.init_container_name:
            continue
        # Safety first: a container whose current run succeeded is never taken for broken.
        current = _map(_map(status.get("state")).get("terminated"))
        if "terminated" in _map(status.get("state")) and (
            current.get("reason") == "Completed" or _exit_code(current) == 0
        ):
            continue
        last = _map(status.get("lastState")).get("terminated")
        if not isinstance(last, dict):
            continue
        message_matches = not wanted_message or wanted_message == _text(last.get("message")).strip()
        code_matches = settings.init_exit_code == 0 or settings.init_exit_code == _exit_code(last)
        if message_matches and code_matches:
            return True
    return False
