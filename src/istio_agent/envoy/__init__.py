"""Envoy process supervision and admin-API client."""
