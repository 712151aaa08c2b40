"""Tests of the ambient node agent."""
