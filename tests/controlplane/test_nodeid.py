"""Node ids istiod refuses, refused here with istiod's words (``pilot/pkg/model/context.go``)."""

from __future__ import annotations

import pytest

from istio_agent.controlplane.nodeid import node_id_error


@pytest.mark.parametrize(
    "node_id",
    [
        "sidecar~10.0.0.1~sleep-1.default~default.svc.cluster.local",
        "router~10.0.0.1~gw-1.istio-system~istio-system.svc.cluster.local",
        "waypoint~fd00::1~wp.default~default.svc.cluster.local",
        "ztunnel~10.0.0.1~zt.istio-system~istio-system.svc.cluster.local",
    ],
)
def test_application_node_types_are_accepted(node_id: str) -> None:
    assert node_id_error(node_id, {}) is None


def test_an_istioctl_node_type_is_refused_as_istiod_words_it() -> None:
    node_id = "istioctl~0.0.0.0~agentctl.istio-system~istio-system.svc.cluster.local"
    assert node_id_error(node_id, {}) == (
        'invalid node type (valid types: [sidecar router waypoint ztunnel]) in the service node "'
        + node_id
        + '"'
    )


@pytest.mark.parametrize("node_id", ["istioctl-debug", "a~b~c", "a~b~c~d~e", ""])
def test_an_id_without_four_parts_is_refused(node_id: str) -> None:
    assert node_id_error(node_id, {}) == f'missing parts in the service node "{node_id}"'


def test_the_ip_comes_from_instance_ips_or_else_from_the_id() -> None:
    no_ip = "sidecar~~sleep-1.default~default.svc.cluster.local"
    assert node_id_error(no_ip, {}) == "no valid IP address in the service node id or metadata"
    assert node_id_error(no_ip, {"INSTANCE_IPS": "10.0.0.1,fd00::1"}) is None
    assert node_id_error(no_ip, {"INSTANCE_IPS": "10.0.0.1,nope"}) is not None  # every one must parse
    assert node_id_error("sidecar~0.0.0.0~a.b~b.svc", {"INSTANCE_IPS": "nope"}) is None  # the id's IP
