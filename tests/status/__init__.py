"""Tests of the status server."""
