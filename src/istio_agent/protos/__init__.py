"""The project's own protos of Istio's APIs and their generated modules.

istio.v1.auth (the CA), istio.networking.nds.v1 (NDS) and istio.mesh.v1alpha1 (ProxyConfig over PCDS).
"""
