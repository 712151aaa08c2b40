"""What ``pilot-agent istio-iptables`` does once its flags are read (the CLI only parses and prints).

In order, as ``tools/istio-iptables/pkg/cmd/root.go``: apply the rules in the current network
namespace (the pod's, in the ``istio-init`` container; ``--network-namespace``: that one) unless
``--skip-rule-apply``; with ``--cleanup-only`` remove them instead and stop; then, with
``--run-validation``, check that the traffic is captured. IPv6 is decided from the namespace's
addresses, as Istio does (``--dual-stack``: any IPv6 address). At the end the resulting rules are
logged, as istio-iptables prints them.

``--native-nftables`` writes the same capture as an nftables ruleset (``istio_agent.cni.nftables``,
Istio's ``tools/istio-nftables``); it is imported only then.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from istio_agent.cni.apply import ApplyError, apply_capture
from istio_agent.cni.capture_config import CaptureConfig, RunMode
from istio_agent.cni.iptables import Backend, detect
from istio_agent.cni.netns import CommandError, NamespaceError, in_namespace, pod_ipv6
from istio_agent.cni.validation import EXIT_FAILED, Probe, validate
from istio_agent.log import scope

log = scope("default")


def run(config: CaptureConfig, mode: RunMode, env: Mapping[str, str]) -> int:
    """The exit status: 0, or 126 when validation fails; an ApplyError when applying does."""
    netns = mode.network_namespace
    try:
        ipv6 = pod_ipv6(netns, dual_stack=config.enable_ipv6)
    except CommandError as err:
        where = f"network namespace {netns}" if netns else "this network namespace"
        raise ApplyError(f"cannot read the addresses of {where}: {err}") from None
    config = dataclasses.replace(config, enable_ipv6=ipv6)
    if not mode.skip_rule_apply:
        if mode.native_nftables:
            _apply_nftables(config, mode, env)
        else:
            _apply_iptables(config, mode, env)
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
    try:
        passed = in_namespace(netns, lambda: validate(probe))
    except NamespaceError as err:
        raise ApplyError(f"cannot validate: {err}") from None
    return 0 if passed else EXIT_FAILED


def dry_run(config: CaptureConfig, mode: RunMode) -> str:
    """The rules ``run`` would write, as the backend's input (iptables-restore or ``nft -f``)."""
    if mode.native_nftables:
        from istio_agent.cni.nftables.builder import render_config

        return render_config(config)
    from istio_agent.cni.rules import render_families

    v4, v6 = render_families(config)
    return v4 + (v6 or "")


def _apply_iptables(config: CaptureConfig, mode: RunMode, env: Mapping[str, str]) -> None:
    netns = mode.network_namespace
    backend = _backend(mode, env)
    if mode.force_apply and not mode.cleanup_only:
        # Istio's break-glass for a state check that might be wrong: never trust "already in place".
        removed = apply_capture(config, netns=netns, cleanup_only=True, backend=backend, read_back=False)
        log.info("--force-apply: the installed Istio rules were %s before writing them anew", removed.action)
    outcome = apply_capture(config, netns=netns, cleanup_only=mode.cleanup_only, backend=backend)
    log.info("iptables rules %s (%s, IPv6 %s)", outcome.action, outcome.backend, _on(config.enable_ipv6))
    for family, saved in outcome.saved.items():
        log.info("%s-save:\n%s", outcome.backend.binary(family), saved.rstrip("\n"))


def _apply_nftables(config: CaptureConfig, mode: RunMode, env: Mapping[str, str]) -> None:
    from istio_agent.cni.nftables.apply import apply_nft_capture

    netns = mode.network_namespace
    if mode.force_apply and not mode.cleanup_only:
        removed = apply_nft_capture(config, netns=netns, cleanup_only=True, read_back=False, env=env)
        log.info("--force-apply: the installed Istio tables were %s before writing them anew", removed.action)
    outcome = apply_nft_capture(config, netns=netns, cleanup_only=mode.cleanup_only, env=env)
    log.info("nftables rules %s (%s, IPv6 %s)", outcome.action, outcome.nft, _on(config.enable_ipv6))
    if outcome.ruleset:
        log.info("nft list:\n%s", outcome.ruleset.rstrip("\n"))


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _backend(mode: RunMode, env: Mapping[str, str]) -> Backend:
    """The iptables backend of the current namespace (--force-iptables-binary wins), as Istio detects it."""
    try:
        backend = detect({**env, "FORCE_IPTABLES_BINARY": mode.iptables_binary})
    except CommandError as err:
        raise ApplyError(str(err)) from None
    return dataclasses.replace(backend, pod_lock=mode.cni_mode) if mode.cni_mode else backend
