"""The node agent's side of the plugin's ambient ADD: ``POST /cmdadd`` on ``pluginevent.sock``.

Istio's ``cni/pkg/nodeagent/cni-watcher.go`` and ``cni/pkg/pluginlistener``: an HTTP server on a Unix
socket in the agent's run dir (the socket 0666, so the plugin, run by the container runtime, can
connect; the directory 0750). Each event names the pod, its network namespace and the addresses the
chain gave it; the agent checks the pod is ambient in its own cache (retrying briefly: the cache may
not have seen the pod yet), then enrolls it (:mod:`.dataplane`). The answer is what the plugin's ADD
becomes: 400 for a body that is not an event, 500 (with the reason) when the pod could not be
enrolled, 200 when it was. ``istio_cni_plugin_requests_total{response_code}`` counts the answers.

The server is the project's HTTP stack (``istio_agent.http.server``) on an ``AF_UNIX`` socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from istio_agent.cni.ambient.dataplane import Dataplane
from istio_agent.http.messages import Request, Response, StreamResponse
from istio_agent.http.server import ServerRunner, SockSite
from istio_agent.log import scope
from istio_agent.metrics import Registry

log = scope("cni-agent")

SOCKET_NAME = "pluginevent.sock"
ADD_PATH = "/cmdadd"
STALE_RETRIES = 10
STALE_INTERVAL = 0.01
"""Istio looks for the pod in its cache 10 more times, 10 ms apart, before giving up."""
MAX_EVENT_BYTES = 2**20


class AddEvent(NamedTuple):
    """Istio's ``CNIPluginAddEvent``: the pod's netns path, its name and the addresses the chain gave it."""

    netns: str
    pod_name: str
    pod_namespace: str
    ips: tuple[str, ...]


PodLookup = Callable[[str, str], "Mapping[str, Any] | None"]
"""``(name, namespace)``: the pod when it is ambient, None when it is not; KeyError when the cache
does not hold it (or its namespace)."""
EventHandler = Callable[[AddEvent], Awaitable[None]]


def parse_event(body: bytes) -> AddEvent:
    """The event as Go's ``json.Unmarshal`` into ``CNIPluginAddEvent`` reads it; ValueError otherwise."""
    document = json.loads(body)
    if not isinstance(document, dict):
        raise ValueError("json: cannot unmarshal into Go value of type nodeagent.CNIPluginAddEvent")
    fields = {key.lower(): value for key, value in document.items()}
    strings = {}
    for name in ("netns", "podname", "podnamespace"):
        value = fields.get(name)
        if value is not None and not isinstance(value, str):
            raise ValueError(
                f"json: cannot unmarshal into Go struct field CNIPluginAddEvent.{name} of type string"
            )
        strings[name] = value or ""
    ips = []
    for entry in fields.get("ips") or ():
        address = entry.get("Address") if isinstance(entry, dict) else None
        ip = address.get("IP") if isinstance(address, dict) else None
        try:
            ips.append(str(ipaddress.ip_address(ip)) if ip else "")
        except ValueError:
            raise ValueError(f"invalid IP address: {ip}") from None
    return AddEvent(
        strings["netns"], strings["podname"], strings["podnamespace"], tuple(ip for ip in ips if ip)
    )


async def reconcile_add_event(
    event: AddEvent,
    lookup: PodLookup,
    dataplane: Dataplane,
    *,
    retries: int = STALE_RETRIES,
    interval: float = STALE_INTERVAL,
) -> None:
    """Istio's ``ReconcileCNIAddEvent``: the pod from the cache (retried), then enrolled; raises with the reason."""
    pod: Mapping[str, Any] | None = None
    for attempt in range(retries + 1):
        try:
            pod = lookup(event.pod_name, event.pod_namespace)
            break
        except KeyError as err:
            if attempt == retries:
                raise RuntimeError(
                    f"failed to get pod {event.pod_namespace}/{event.pod_name}: {err}"
                ) from None
            log.warning(
                "got an event for pod %s in namespace %s not found in current pod cache, retry %d of %d",
                event.pod_name,
                event.pod_namespace,
                attempt,
                retries,
            )
            await asyncio.sleep(interval)
    if pod is None:
        raise RuntimeError(
            f"pod {event.pod_namespace}/{event.pod_name} is unexpectedly not eligible for ambient enrollment"
        )
    await dataplane.add_pod(pod, event.ips, event.netns)


class EventServer:
    """The HTTP server on ``socket_path``; ``handle`` enrolls the pod of each event (raising the reason)."""

    def __init__(self, socket_path: Path, handle: EventHandler, registry: Registry) -> None:
        self.socket_path = socket_path
        self._handle = handle
        self._requests = registry.counter(
            "cni_plugin_requests_total",
            "Requests from the CNI plugin, by the answer given",
            ["response_code"],
        )
        self._runner: ServerRunner | None = None

    async def start(self) -> None:
        """Listen (a socket file left by an earlier run is replaced); OSError naming the path."""
        path = self.socket_path
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        try:
            path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        except OSError as err:  # Istio only warns: the listen below says what is wrong
            log.warning("failed to create directory for %s: %s", path, err)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
            os.chmod(path, 0o666)
            sock.listen(128)
            sock.setblocking(False)
        except OSError as err:
            sock.close()
            raise OSError(
                err.errno, f"failed to listen on unix socket {str(path)!r}: {err.strerror}"
            ) from None
        runner = ServerRunner(self._serve)
        await SockSite(runner, sock).start()
        self._runner = runner
        log.info("starting listener for CNI plugin events at %s", path)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    async def _serve(self, request: Request) -> StreamResponse:
        if request.path != ADD_PATH:
            return Response(404, text="404 page not found\n")
        response = await self._add(request)
        self._requests.labels(response_code=str(response.status)).inc()
        return response

    async def _add(self, request: Request) -> Response:
        try:
            event = parse_event(await request.read())
        except Exception as err:  # not JSON, not an event, too large
            log.error("failed to process CNI event payload: %s", err)
            return Response(400, text=f"{err}\n")
        try:
            await self._handle(event)
        except Exception as err:
            log.error("pod %s/%s: failed to handle add event: %s", event.pod_namespace, event.pod_name, err)
            return Response(500, text=f"{err}\n")
        return Response(200)
