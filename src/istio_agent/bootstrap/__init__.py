"""Pure functions from configuration to Envoy bootstrap pieces (dicts in Envoy's JSON form)."""
