"""One downstream xDS stream's state, shared by its relay tasks, the health reports and the debug tap."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from istio_agent.xds.flavour import Flavour


@dataclass(eq=False)
class ProxyStream:
    id: int
    flavour: Flavour
    call: Any = None
    """The upstream call to istiod, once opened."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Serialises writes to ``call``: Envoy's requests and the agent's own (ACKs, health, debug)."""
    health_wake: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: tuple[asyncio.Task[None], ...] = ()
    initial_sent: bool = False
    answered: bool = False
    """istiod has sent at least one response on this stream (the connection attempt succeeded)."""
    half_closed: bool = False
    stopping: bool = False
    extension_configs: asyncio.Queue[bytearray] = field(default_factory=asyncio.Queue)
    """ECDS responses waiting for their Wasm modules, converted one after another so Envoy gets
    them in istiod's order, while other types go on past them."""
    extension_config_version: str = ""
    """The last ECDS version Envoy acknowledged: what a SotW NACK of a conversion carries."""

    def shutdown(self) -> None:
        self.stopping = True
        for task in self.tasks:
            task.cancel()
