"""The local control plane: an Istio-CA-compatible signer (and later ADS) fed by a YAML mesh file.

A development tool for one machine, demos and tests; in a real cluster istiod plays this part.
"""

DEFAULT_ADDRESS = "127.0.0.1:15010"
DEFAULT_SECURE_ADDRESS = "127.0.0.1:15012"
"""Where the local control plane serves by default: istiod's plaintext and TLS ports, on loopback."""
