"""What ``pilot-agent istio-iptables`` does once its flags are read (the CLI only parses and prints).

In order, as ``tools/istio-iptables/pkg/cmd/root.go``: apply the rules in the current network
namespace (the pod's, in the ``istio-init`` container) unless ``--skip-rule-apply``; with
``--cleanup-only`` remove them instead and stop; then, with ``--run-validation``, check that the
traffic is captured. IPv6 is decided from the namespace's addresses, as Istio does (``--dual-stack``:
any IPv6 address). At the end the resulting rules are logged, as istio-iptables prints them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from istio_agent.cni.apply import ApplyError, apply_capture
from istio_agent.cni.capture_config import CaptureConfig, RunMode
from istio_agent.cni.netns import CommandError, pod_ipv6
from istio_agent.cni.validation import EXIT_FAILED, Probe, validate
from istio_agent.log import scope

log = scope("default")


def run(config: CaptureConfig, mode: RunMode, env: Mapping[str, str]) -> int:
    """The exit status: 0, or 126 when validation fails; an ApplyError when applying does."""
    try:
        ipv6 = pod_ipv6(None, dual_stack=config.enable_ipv6)
    except CommandError as err:
        raise ApplyError(f"cannot read this network namespace's addresses: {err}") from None
    config = dataclasses.replace(config, enable_ipv6=ipv6)
    if not mode.skip_rule_apply:
        outcome = apply_capture(config, cleanup_only=mode.cleanup_only, env=env)
        log.info("iptables rules %s (%s, IPv6 %s)", outcome.action, outcome.backend, "on" if ipv6 else "off")
        for family, saved in outcome.saved.items():
            log.info("%s-save:\n%s", outcome.backend.binary(family), saved.rstrip("\n"))
        if mode.cleanup_only:
            return 0
    if not mode.run_validation:
        return 0
    probe = Probe(
        proxy_port=config.proxy_port,
        inbound_capture_port=config.inbound_capture_port,
        probe_port=mode.probe_port,
        timeout=mode.probe_timeout,
        ipv6=ipv6,
    )
    return 0 if validate(probe) else EXIT_FAILED
