"""xDS: the stream core every xDS server uses, the proxy between Envoy and istiod, its dialer, the agent's types.

Nothing is re-exported: importing one module (``xds.flavour``) must not load the proxy, its dialer
and what they need.
"""
