"""The CNI node agent's parts: the sidecar capture rule set (istio-iptables), and next its applier,
the istio-cni plugin and install-cni."""
