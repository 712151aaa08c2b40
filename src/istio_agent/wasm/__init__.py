"""Remote Wasm modules for Envoy: ECDS conversion, fetching (HTTP and OCI), the module cache.

Istio's agent does the same in ``pkg/wasm``; see docs/wasm.md.
"""
