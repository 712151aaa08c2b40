def sample(name: str, labels: dict[str, str] | None = None) -> float:
    """A sample of the process's default registry (what these DNS objects count into when built bare)."""
    from istio_agent.metrics import PREFIX, REGISTRY

    return REGISTRY.sample(PREFIX + name, labels) or 0.0
