"""Ambient mode of the CNI node agent: in-pod redirection and the pod's netns handed to ztunnel.

Istio's ``cni/pkg/nodeagent``, ``cni/pkg/iptables``, ``cni/pkg/nftables`` and ``pkg/zdsapi``; see docs/cni.md.
"""
