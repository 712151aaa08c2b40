"""Workload identity: keys and CSRs, the CA client, the secret manager and the SDS server."""
