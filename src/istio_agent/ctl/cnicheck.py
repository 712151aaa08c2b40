"""The flow of ``agentctl cni check``: which rules a pod should have, compared with what it has.

The expected rules come from the pod object (a file as ``kubectl get pod -o json`` prints it, or
fetched with a kubeconfig), decided exactly as the istio-cni plugin decides them
(``cni/redirect.py``); without a pod, from the defaults of an injected pod without annotations.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from istio_agent.cni import pod as pod_object
from istio_agent.cni import redirect
from istio_agent.cni.capture_config import CaptureConfig, split
from istio_agent.cni.check import CheckError, CheckReport, check_capture, pod_netns
from istio_agent.config.document import DocumentSyntaxError, load_document
from istio_agent.config.env import ConfigError

DEFAULT_POD: dict[str, Any] = {
    "metadata": {"annotations": {pod_object.STATUS_ANNOTATION: "{}"}},
    "spec": {"containers": [{"name": pod_object.PROXY_CONTAINER}]},
}
"""An injected pod with no annotations of its own: the rules every default sidecar gets."""
TIMEOUT = 10.0
STATUS_PORT_ANNOTATION = "status.sidecar.istio.io/port"
KINDS = {
    "missing": "MISSING",
    "unexpected": "LEFTOVER",
    "misplaced": "MISPLACED",
    "missing-chain": "MISSING CHAIN",
    "unexpected-chain": "LEFTOVER CHAIN",
}


def load_pod(path: Path) -> dict[str, Any]:
    """A pod object from a JSON or YAML file."""
    try:
        pod = load_document(path.read_text())
    except OSError as err:
        raise CheckError(f"cannot read {path}: {err.strerror or err}") from None
    except DocumentSyntaxError as err:
        raise CheckError(f"{path}: {err}") from None
    if not isinstance(pod, dict) or pod.get("kind", "Pod") != "Pod":
        raise CheckError(f"{path}: not a Pod object")
    return pod


def fetch_pod(kubeconfig: Path, name: str) -> dict[str, Any]:
    """The pod ``NAMESPACE/NAME`` from the API server of ``kubeconfig`` (as the plugin fetches it)."""
    from istio_agent.cni.kube import KubeClient, KubeError, read_kubeconfig

    namespace, _, pod_name = name.rpartition("/")
    if not namespace or not pod_name:
        raise CheckError(f"--pod-name {name!r}: expected NAMESPACE/NAME")
    try:
        client = KubeClient(read_kubeconfig(kubeconfig))
        return client.get_pod_blocking(namespace, pod_name, deadline=time.monotonic() + TIMEOUT)
    except (ConfigError, KubeError) as err:
        raise CheckError(str(err)) from None


def expected_config(pod: Mapping[str, Any], env: Mapping[str, str]) -> tuple[CaptureConfig | None, str]:
    """The capture the pod should have (None: no rules at all), and why, in words."""
    reason = pod_object.skip_reason(pod)
    try:
        if reason is None:
            return redirect.capture_config(pod, env), "the pod is injected: the plugin sets up its capture"
        if pod_object.has_init_container(pod):  # istio-init writes the same rules from the same annotations
            config = redirect.capture_config(pod, env)
            config = dataclasses.replace(
                config,
                inbound_ports_exclude=istio_init_exclusions(pod),
                outbound_ports_exclude=istio_init_outbound_exclusions(pod),
            )
            return config, "the pod's istio-init container sets up its capture"
    except ConfigError as err:
        raise CheckError(str(err)) from None
    return None, f"no capture expected: {reason}"


def istio_init_exclusions(pod: Mapping[str, Any]) -> tuple[int, ...]:
    """The inbound ports istio-init excludes, in its order (Istio's injection template renders ``-d`` as
    ``15090,15021,`` then the pod's ``excludeInboundPorts`` with the status port appended when it is
    not listed: ``excludeInboundPort``). The plugin orders the same ports its own way (annotation
    first, then 15020,15021,15090), so only the order differs."""
    annotations = pod_object.metadata(pod, "annotations")
    status_port = str(annotations.get(STATUS_PORT_ANNOTATION, "15020")).strip()
    listed = list(split(str(annotations.get(redirect.EXCLUDE_INBOUND, ""))))
    if status_port not in listed:
        listed.append(status_port)
    return tuple(
        dict.fromkeys(
            redirect.annotation_ports(redirect.EXCLUDE_INBOUND, ",".join(["15090", "15021", *listed]))
        )
    )


def istio_init_outbound_exclusions(pod: Mapping[str, Any]) -> tuple[int, ...]:
    """The outbound ports istio-init excludes: the injector passes ``-o`` only when the pod has the
    ``excludeOutboundPorts`` annotation (the plugin's default of 15020 is its own)."""
    listed = str(pod_object.metadata(pod, "annotations").get(redirect.EXCLUDE_OUTBOUND, ""))
    return redirect.annotation_ports(redirect.EXCLUDE_OUTBOUND, listed)


def run(
    target: str,
    pod: Mapping[str, Any] | None,
    output: str,
    out: Callable[[str], None],
    env: Mapping[str, str],
) -> bool:
    """Check, print the report; True when the installed rules are exactly the expected ones.

    ``pod`` None: the rules of an injected pod without annotations of its own.
    """
    config, why = expected_config(pod or DEFAULT_POD, env)
    if pod is None:
        why = "no pod given: the defaults of an injected pod"
    netns = pod_netns(target)
    report = check_capture(config, netns, deadline=time.monotonic() + TIMEOUT, env=env)
    if output == "json":
        out(json.dumps(as_json(report, why), indent=2))
    else:
        for line in as_text(report, why):
            out(line)
    return report.matches


def as_text(report: CheckReport, why: str) -> list[str]:
    families = "IPv4 and IPv6" if "v6" in report.families else "IPv4"
    lines = [
        f"network namespace {report.netns} ({report.backend}, {families}): {why}",
        f"expected {report.expected_rules} Istio rules, installed {report.installed_rules}",
    ]
    if report.matches:
        lines.append("OK: the installed rules are exactly the expected ones")
        return lines
    width = max(len(KINDS[d.kind]) for d in report.differences)
    for d in report.differences:
        where = f"{d.family} {d.table} {d.chain}"
        lines.append(f"{KINDS[d.kind]:<{width}}  {where}" + (f"  {d.rule}" if d.rule else ""))
    lines.append(f"{len(report.differences)} difference(s)")
    return lines


def as_json(report: CheckReport, why: str) -> dict[str, Any]:
    return {
        "netns": str(report.netns),
        "backend": str(report.backend),
        "families": list(report.families),
        "expectation": why,
        "expectedRules": report.expected_rules,
        "installedRules": report.installed_rules,
        "matches": report.matches,
        "differences": [
            {"kind": d.kind, "family": d.family, "table": d.table, "chain": d.chain, "rule": d.rule}
            for d in report.differences
        ],
    }
