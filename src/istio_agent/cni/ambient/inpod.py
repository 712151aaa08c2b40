"""Applying ambient's in-pod redirection in a pod's network namespace."""

from __future__ import annotations

from istio_agent.cni.ambient.inpod_rules import iptables_rules, nft_rules, render_nft
from istio_agent.cni.ambient.settings import InpodSettings, PodRedirect, dns_capture

__all__ = ["InpodSettings", "PodRedirect", "dns_capture", "iptables_rules", "nft_rules", "render_nft"]
