"""Every object that counts metrics is told which registry to count into.

A default of the process registry let tests and embedded uses (the benches, several agents in one
process) count into one shared registry by accident; only the CLI entry points use it (issue 23).
"""

from __future__ import annotations

import importlib
import inspect

import pytest

COUNTING = [
    ("istio_agent.xds.proxy", "XdsProxy"),
    ("istio_agent.controlplane.ads", "AdsServer"),
    ("istio_agent.controlplane.server", "ControlPlane"),
    ("istio_agent.dns.proxy", "DnsProxy"),
    ("istio_agent.dns.cache", "AnswerCache"),
    ("istio_agent.dns.upstream", "Forwarder"),
    ("istio_agent.dns.server", "DnsServer"),
    ("istio_agent.health.checker", "HealthChecker"),
    ("istio_agent.envoy.supervisor", "EnvoySupervisor"),
    ("istio_agent.envoy.readiness", "EnvoyReadiness"),
    ("istio_agent.status.server", "StatusServer"),
    ("istio_agent.filewatch", "FileWatcher"),
    ("istio_agent.agent", "Agent"),
    ("istio_agent.security.caclient", "CitadelClient"),
    ("istio_agent.security.manager", "SecretManager"),
    ("istio_agent.security.sds", "SdsServer"),
]


@pytest.mark.parametrize(("module", "name"), COUNTING)
def test_the_registry_is_a_required_keyword(module: str, name: str) -> None:
    parameter = inspect.signature(getattr(importlib.import_module(module), name)).parameters["registry"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
    assert parameter.default is inspect.Parameter.empty


@pytest.mark.parametrize(("module", "name"), COUNTING)
def test_no_constructor_reaches_for_the_process_registry(module: str, name: str) -> None:
    assert "REGISTRY" not in vars(importlib.import_module(module)), f"{module} imports the process registry"
