from __future__ import annotations

from istio_agent.metrics import PREFIX, Registry


def sample(registry: Registry, name: str, labels: dict[str, str] | None = None) -> float:
    """A sample of ``registry`` under the agent's metric prefix (0 when nothing was counted yet)."""
    return registry.sample(PREFIX + name, labels) or 0.0
