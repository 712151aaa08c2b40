"""The project's own protos of Istio's APIs and their generated modules.

istio.v1.auth (the CA), istio.networking.nds.v1 (NDS), istio.mesh.v1alpha1 (ProxyConfig over PCDS),
grpc.health.v1's two messages for gRPC health probes (``health.proto``), and istio.workload.zds (the
ambient node agent's protocol with ztunnel, ``zds.proto``). Messages only: no grpcio stubs.
"""
