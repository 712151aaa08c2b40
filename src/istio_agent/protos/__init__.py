"""The project's own protos of Istio's APIs and their generated modules.

istio.v1.auth (the CA), istio.networking.nds.v1 (NDS), istio.mesh.v1alpha1 (ProxyConfig over PCDS), and
grpc.health.v1's two messages for gRPC health probes (``health.proto``). Messages only: no grpcio stubs.
"""
