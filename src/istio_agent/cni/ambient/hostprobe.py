"""Applying ambient's host-probe rules (see :mod:`istio_agent.cni.ambient.hostprobe_rules`)."""

from __future__ import annotations

from istio_agent.cni.ambient.hostprobe_rules import iptables_rules, nft_rules, nft_sets, render_nft

__all__ = ["iptables_rules", "nft_rules", "nft_sets", "render_nft"]
