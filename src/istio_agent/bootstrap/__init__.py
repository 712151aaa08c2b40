"""Pure functions from configuration to bootstraps: Envoy's and proxyless gRPC's (dicts in their JSON form)."""
