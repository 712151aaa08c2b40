"""The project's own API protos (istio.v1.auth, istio.networking.nds.v1, grpc.health.v1) and their generated modules."""
