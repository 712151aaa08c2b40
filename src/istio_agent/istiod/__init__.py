"""Talking to istiod: the token the agent shows it (``tokens``) and the one way to dial it (``dial``).

Used by the CA client (``security.caclient``) and the xDS proxy's upstream (``xds.upstream``) alike.
"""
