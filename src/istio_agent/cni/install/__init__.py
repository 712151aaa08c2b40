"""install-cni: the node agent that installs the istio-cni plugin and keeps the node's CNI config chained to it.

``settings`` (flags and env, Istio's names), ``conffiles`` (finding, choosing, editing the CNI config
files), ``kubeconfig`` and ``binaries`` (what the plugin needs on the host), ``guard`` (the conflict
back-off), ``watch`` (waiting for a change), ``installer`` (the install pass, the watch loop, cleanup)
and ``servers`` (health and metrics). Istio's counterpart: ``cni/pkg/install``, ``cni/pkg/cmd/root.go``.
"""
