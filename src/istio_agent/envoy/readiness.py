"""Envoy's own readiness, read from its admin API: config received (CDS and LDS), then LIVE.

Istio's is ``pilot/cmd/pilot-agent/status/ready/probe.go``. Both the status server's
``/healthz/ready`` (docs/status.md) and the VM health checks (``istio_agent.probe.workload``) ask
it. Stages that have passed once are cached forever, as in Istio: a later Envoy hiccup must not flap
the pod, and once ready the check costs no admin calls.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from urllib.parse import quote

from istio_agent.envoy.admin import AdminError, admin_request
from istio_agent.log import scope
from istio_agent.metrics import Registry

log = scope("healthcheck")


CONFIG_TIMEOUT = 1.0
LIVE_TIMEOUT = 3.0
CONFIG_FILTER = r"^(cluster_manager\.cds|listener_manager\.lds)\.(update_success|update_rejected)$"
LIVE_FILTER = r"^(server\.state|listener_manager\.workers_started)"
SERVER_STATES = {0: "LIVE", 1: "DRAINING", 2: "PRE_INITIALIZING", 3: "INITIALIZING"}

_CDS_SUCCESS = "cluster_manager.cds.update_success"
_CDS_REJECTED = "cluster_manager.cds.update_rejected"
_LDS_SUCCESS = "listener_manager.lds.update_success"
_LDS_REJECTED = "listener_manager.lds.update_rejected"
_SERVER_STATE = "server.state"
_WORKERS_STARTED = "listener_manager.workers_started"


class _ReadinessMetrics:
    """Envoy readiness' metrics (Istio's names)."""

    def __init__(self, registry: Registry) -> None:
        self.startup_duration = registry.gauge(
            "startup_duration_seconds", "The time from the process starting to being marked ready."
        )


class StatsError(ValueError):
    """Envoy's /stats output could not be read."""


def parse_stats(body: str, names: Sequence[str]) -> dict[str, int]:
    """Values of ``name: value`` lines for the given names (first line with each prefix wins; missing -> 0)."""
    values: dict[str, int] = {}
    for line in body.splitlines():
        for name in names:
            if name in values or not line.startswith(name):
                continue
            _, sep, raw = line.partition(":")
            if not sep:
                continue
            try:
                values[name] = int(raw.strip())
            except ValueError:
                raise StatsError(f"failed to parse Envoy stat {line.strip()[:200]!r}") from None
    return {name: values.get(name, 0) for name in names}


class EnvoyReadiness:
    """Envoy has received its first CDS and LDS updates and is LIVE with workers started."""

    def __init__(self, admin_host: str, admin_port: int, *, started_at: float, registry: Registry) -> None:
        self._metrics = _ReadinessMetrics(registry)
        self._host, self._port = admin_host, admin_port
        self._started_at = started_at
        self._config_received = False
        self._live = False

    async def check(self) -> str | None:
        error = await self.config_status()
        if error is not None:
            return error
        return await self.live_status()

    async def config_status(self) -> str | None:
        """Stage 1: config received from the XDS server (cached once passed)."""
        if self._config_received:
            return None
        try:
            body = await self._stats(CONFIG_FILTER, CONFIG_TIMEOUT)
            stats = parse_stats(body, (_CDS_SUCCESS, _CDS_REJECTED, _LDS_SUCCESS, _LDS_REJECTED))
        except StatsError as err:
            return str(err)
        cds_updated = stats[_CDS_SUCCESS] > 0
        lds_updated = stats[_LDS_SUCCESS] > 0
        if cds_updated and lds_updated:
            self._config_received = True
            return None
        summary = (
            f"cds updates: {stats[_CDS_SUCCESS]} successful, {stats[_CDS_REJECTED]} rejected; "
            f"lds updates: {stats[_LDS_SUCCESS]} successful, {stats[_LDS_REJECTED]} rejected"
        )
        if not cds_updated and not lds_updated:
            return f"config not received from XDS server (is Istiod running?): {summary}"
        if stats[_CDS_REJECTED] > 0 or stats[_LDS_REJECTED] > 0:
            return f"config received from XDS server, but was rejected: {summary}"
        return f"config not fully received from XDS server: {summary}"

    async def live_status(self) -> str | None:
        """Stage 2: Envoy is LIVE and its workers started; records the startup duration (cached once passed)."""
        if self._live:
            return None
        try:
            body = await self._stats(LIVE_FILTER, LIVE_TIMEOUT)
            if _SERVER_STATE not in body:
                return f"{_SERVER_STATE} is not yet updated: {body.strip()}"
            if _WORKERS_STARTED not in body:
                return f"{_WORKERS_STARTED} is not yet updated: {body.strip()}"
            stats = parse_stats(body, (_SERVER_STATE, _WORKERS_STARTED))
        except StatsError as err:
            return str(err)
        state = stats[_SERVER_STATE]
        if state != 0:
            return f"server is not live, current state is: {SERVER_STATES.get(state, 'UNKNOWN')}"
        if stats[_WORKERS_STARTED] != 1:
            return "workers have not yet started"
        self._live = True
        elapsed = time.monotonic() - self._started_at
        self._metrics.startup_duration.set(elapsed)
        log.info("Envoy is live after %.3fs", elapsed)
        return None

    async def _stats(self, pattern: str, timeout: float) -> str:
        # The regex is percent-encoded: Envoy decodes query parameters, and a raw `\` or `^` is not valid
        # in a request line for strict HTTP parsers.
        target = f"/stats?usedonly&filter={quote(pattern, safe='')}"
        try:
            status, body = await admin_request(self._host, self._port, "GET", target, timeout=timeout)
        except AdminError as err:
            raise StatsError(f"failed to get Envoy stats: {err}") from None
        if status != 200:
            raise StatsError(f"failed to get Envoy stats: HTTP status code {status}")
        return body
