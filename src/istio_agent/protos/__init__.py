"""Istio API protos (istio.v1.auth, istio.networking.nds.v1) and their generated modules."""
