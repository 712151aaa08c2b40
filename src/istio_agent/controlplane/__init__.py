"""The local control plane: an Istio-CA-compatible signer (and later ADS) fed by a YAML mesh file.

A development tool for one machine, demos and tests; in a real cluster istiod plays this part.
"""
