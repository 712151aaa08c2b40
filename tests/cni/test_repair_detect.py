"""Which pods the repair controller takes for broken: the cases of Istio's ``TestMatchesFilter``
(``cni/pkg/repair/repair_test.go`` and the pods of ``repair_test_helpers.go``), as JSON pods."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from istio_agent.cni.install.settings import RepairSettings
from istio_agent.cni.repair.detect import is_broken
from tests.cni.fake_kube import validation_crashlooping, validation_passed

STATUS = "sidecar.istio.io/status"
BY_CODE = RepairSettings(
    sidecar_annotation=STATUS, init_container_name="istio-validation", init_exit_code=126
)


def pod(init_status: dict[str, Any], *, annotated: bool = True) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "p",
            "namespace": "default",
            "annotations": {STATUS: "something"} if annotated else {},
        },
        "spec": {
            "initContainers": [{"name": init_status.get("name", "")}],
            "containers": [{"name": "payload"}],
        },
        "status": {
            "initContainerStatuses": [init_status],
            "containerStatuses": [{"name": "payload", "state": {"waiting": {"reason": "PodInitializing"}}}],
        },
    }


def terminated(code: int, reason: str = "Error", message: str = "Died for some reason") -> dict[str, Any]:
    return {"terminated": {"exitCode": code, "reason": reason, "message": message}}


BROKEN_WAITING = {
    "name": "istio-validation",
    "state": {
        "waiting": {"reason": "CrashLoopBackOff", "message": "Back-off 5m0s restarting failed blah blah blah"}
    },
    "lastState": terminated(126),
}
BROKEN_TERMINATED = {"name": "istio-validation", "state": terminated(126), "lastState": terminated(126)}
WORKING_DIED_BEFORE = {
    "name": "istio-validation",
    "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
    "lastState": terminated(126),
}
WORKING = {"name": "istio-validation", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}


def detect_pod(message: str, code: int) -> dict[str, Any]:
    return pod(
        {
            "name": "istio-validation",
            "state": BROKEN_WAITING["state"],
            "lastState": {"terminated": {"message": message, "exitCode": code}},
        }
    )


@pytest.mark.parametrize(
    ("settings", "subject", "broken"),
    [
        pytest.param(BY_CODE, pod(WORKING), False, id="ok pod"),
        pytest.param(BY_CODE, pod(WORKING_DIED_BEFORE), False, id="working pod that died before"),
        pytest.param(BY_CODE, pod(BROKEN_WAITING), True, id="broken, waiting"),
        pytest.param(BY_CODE, pod(BROKEN_TERMINATED), True, id="broken, terminated"),
        pytest.param(replace(BY_CODE, init_exit_code=55), pod(BROKEN_WAITING), False, id="other exit code"),
        pytest.param(BY_CODE, pod(BROKEN_WAITING, annotated=False), False, id="no sidecar annotation"),
        pytest.param(
            replace(BY_CODE, init_exit_code=0, init_termination_message="Termination Message"),
            detect_pod("This Does Not Match", 0),
            False,
            id="message differs",
        ),
        pytest.param(
            replace(BY_CODE, init_exit_code=0, init_termination_message="Termination Message"),
            detect_pod("Termination Message", 0),
            True,
            id="message matches",
        ),
        pytest.param(
            replace(BY_CODE, init_exit_code=0, init_termination_message="            Termination Message"),
            detect_pod("Termination Message              ", 0),
            True,
            id="message matches without surrounding spaces",
        ),
        pytest.param(BY_CODE, detect_pod("", 121), False, id="exit code differs"),
        pytest.param(BY_CODE, detect_pod("", 126), True, id="exit code matches"),
        pytest.param(BY_CODE, pod({}), False, id="badly formatted pod"),
    ],
)
def test_matches_istios_filter(settings: RepairSettings, subject: dict[str, Any], broken: bool) -> None:
    assert is_broken(subject, settings) is broken


def test_the_status_the_kubelet_reports_for_a_pod_without_rules_is_broken() -> None:
    subject = {"metadata": {"annotations": {STATUS: "{}"}}, "status": validation_crashlooping("10.0.0.5")}
    assert is_broken(subject, RepairSettings())
    healthy = {"metadata": {"annotations": {STATUS: "{}"}}, "status": validation_passed("10.0.0.5")}
    assert not is_broken(healthy, RepairSettings())


def test_another_init_container_is_not_looked_at() -> None:
    subject = pod({**BROKEN_WAITING, "name": "my-init"})
    assert not is_broken(subject, BY_CODE)
    assert is_broken(subject, replace(BY_CODE, init_container_name=""))  # "" looks at every init container


@pytest.mark.parametrize(
    "status",
    [None, "text", {"initContainerStatuses": "x"}, {"initContainerStatuses": [None, 3, {"lastState": "x"}]}],
)
def test_malformed_status_is_not_broken(status: Any) -> None:
    assert not is_broken({"metadata": {"annotations": {STATUS: ""}}, "status": status}, BY_CODE)
