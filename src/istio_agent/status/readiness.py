"""Readiness of the workload (``/healthz/ready``, docs/status.md): a chain of probers, first failure wins.

Istio's are ``pilot/cmd/pilot-agent/status/ready/probe.go`` and, for proxyless gRPC,
``pilot/cmd/pilot-agent/status/grpcready/probe.go``.

Kubelet probes Envoy's 15021 listener, which forwards to the agent, so the answer here is the pod's
readiness: Envoy's own (``istio_agent.envoy.readiness``), then the DNS name table when the DNS proxy
runs. Termination is checked before everything, so readiness fails the moment SIGTERM arrives.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from istio_agent.log import scope

log = scope("healthcheck")

DNS_NOT_READY = "istio DNS capture is turned ON and DNS lookup table is not ready yet"


class Prober(Protocol):
    """One readiness condition."""

    async def check(self) -> str | None:
        """``None`` when ready, else why not (shown to operators verbatim)."""
        ...


class DnsReadiness:
    """The DNS proxy is on, so its name table must have arrived over NDS."""

    def __init__(self, table_ready: Callable[[], bool]) -> None:
        self._table_ready = table_ready

    async def check(self) -> str | None:
        return None if self._table_ready() else DNS_NOT_READY


class GrpcBootstrapReadiness:
    """The proxyless gRPC bootstrap file loads and its file_watcher certificates exist.

    Loading is cached after the first success (the file is written once by the agent); the
    certificate files are checked every time because they may appear later.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._files: list[Path] | None = None

    async def check(self) -> str | None:
        if self._files is None:
            try:
                self._files = _file_watcher_files(json.loads(self._path.read_text()))
            except (OSError, ValueError) as err:
                return f"failed loading {self._path}: {getattr(err, 'strerror', None) or err}"
        for path in self._files:
            if not path.exists():
                return f"{path} does not exist"
        return None


def _file_watcher_files(bootstrap: Any) -> list[Path]:
    if not isinstance(bootstrap, dict):
        raise ValueError("bootstrap is not a JSON object")
    providers = bootstrap.get("certificate_providers") or {}
    if not isinstance(providers, dict):
        raise ValueError("certificate_providers is not a JSON object")
    files: list[Path] = []
    for provider in providers.values():
        if not isinstance(provider, dict) or provider.get("plugin_name") != "file_watcher":
            continue
        config = provider.get("config") or {}
        if not isinstance(config, dict):
            raise ValueError("file_watcher config is not a JSON object")
        for key in ("certificate_file", "private_key_file", "ca_certificate_file"):
            value = config.get(key)
            if isinstance(value, str) and value:
                files.append(Path(value))
    return files


class Readiness:
    """The ordered prober chain behind ``/healthz/ready``; logs readiness transitions once each."""

    def __init__(self, probers: Sequence[Prober]) -> None:
        self._probers = list(probers)
        self._terminated: str | None = None
        self._last: str | None = ""  # "" = never checked, None = ready, else the last error logged
        self.became_ready = asyncio.Event()
        """Set by the first check that finds the workload ready."""

    def terminate(self, cause: str) -> None:
        """From now on report ``server is terminated: <cause>`` (the first cause is kept)."""
        if self._terminated is None:
            self._terminated = cause

    @property
    def terminated(self) -> bool:
        return self._terminated is not None

    async def check(self) -> str | None:
        error = await self._evaluate()
        if error is None:
            self.became_ready.set()
            if self._last is not None:
                log.info("Envoy proxy is ready")
        elif error != self._last:
            log.warning("Envoy proxy is NOT ready: %s", error)
        self._last = error
        return error

    async def _evaluate(self) -> str | None:
        if self._terminated is not None:
            return f"server is terminated: {self._terminated}"
        for prober in self._probers:
            try:
                error = await prober.check()
            except Exception as err:  # a broken prober fails readiness, it does not break the endpoint
                log.exception("readiness prober %r failed", prober)
                error = f"readiness check failed: {type(err).__name__}: {err}"
            if error is not None:
                return error
            if self._terminated is not None:  # terminated while a probe was in flight
                return f"server is terminated: {self._terminated}"
        return None
