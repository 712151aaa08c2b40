"""``ISTIO_PROMETHEUS_ANNOTATIONS``: which application endpoints the merged metrics scrape includes.

The injector rewrites a pod's ``prometheus.io/*`` annotations to point Prometheus at the agent and
hands the original ones over in this JSON variable. A bad value is a startup error, as in Istio:
scraping the agent's own port would loop forever, and a reserved Istio port is never the app.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from istio_agent.config.document import Keys, Node, config_errors
from istio_agent.config.env import ConfigError, out_of_range

ENV_NAME = "ISTIO_PROMETHEUS_ANNOTATIONS"
DEFAULT_PATH = "/metrics"
DEFAULT_PORT = "80"

# Ports Istio's own components listen on; an app endpoint there is always a mistake.
RESERVED_PORTS: dict[int, str] = {
    15000: "Envoy admin",
    15001: "Envoy outbound capture",
    15004: "pilot debug",
    15006: "Envoy inbound capture",
    15008: "HBONE tunnel",
    15020: "agent status",
    15021: "Envoy health",
    15053: "agent DNS",
    15090: "Envoy Prometheus",
}

_DIGITS = re.compile(r"[0-9]+")
_FIELDS = ("scrape", "port", "path", "targets")
_TARGET_FIELDS = ("port", "path")


@dataclass(frozen=True)
class ScrapeTarget:
    """One application metrics endpoint, ``http://<host>:<port><path>``."""

    port: int
    path: str

    @property
    def name(self) -> str:
        """The ``target`` label of the per-target success gauge."""
        return f"app:{self.port}{self.path}"


@dataclass(frozen=True)
class PrometheusTargets:
    """The normalised configuration: always at least one target, in the configured order.

    ``port``/``path`` are the top-level fields after Istio's normalisation (legacy defaults, or
    copied from the first target when missing); only ``targets`` drives scraping.
    """

    targets: tuple[ScrapeTarget, ...]
    scrape: str = ""
    port: str = ""
    path: str = ""


def _error(field: str, problem: str) -> ConfigError:
    return ConfigError(f"{ENV_NAME}: {field}: {problem}")


def _check_port(text: str, field: str, status_port: int) -> int:
    """Compare numerically: ``"015020"`` is the status port too."""
    value = text.strip()
    if not _DIGITS.fullmatch(value):
        raise _error(field, f"port {text!r} is not an integer")
    port = int(value)
    problem = out_of_range(port, 1, 65535)
    if problem is not None:
        raise _error(field, f"port {text!r} {problem}")
    if port == status_port:
        raise _error(field, f"port {text!r} is the agent's status port; scraping it would loop")
    reserved = RESERVED_PORTS.get(port)
    if reserved is not None:
        raise _error(field, f"port {text!r} is reserved by Istio ({reserved})")
    return port


def _normalise_path(path: str) -> str:
    if not path:
        return DEFAULT_PATH
    # Istio would build an invalid URL from "metrics"; a leading slash is what was meant.
    return path if path.startswith("/") else "/" + path


def parse_prometheus_annotations(text: str | None, status_port: int) -> PrometheusTargets | None:
    """Parse and validate the variable; ``None`` when unset or ``scrape`` is ``"false"``.

    Set but empty is not the same as unset: it is invalid JSON, so a startup error as in Istio.
    """
    if text is None:
        return None
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{ENV_NAME}: invalid JSON: {exc}") from None
    # Go's encoding/json into Istio's struct of strings (pkg/istio-agent/metrics: PrometheusScrapeConfiguration).
    fields = Node(raw, "", config_errors(f"{ENV_NAME}: ")).fields(_FIELDS, Keys.GO_JSON)
    scrape, port, path = (fields[name].string() for name in ("scrape", "port", "path"))
    pairs: list[tuple[str, str]] = []
    for item in fields["targets"].items():
        target = item.fields(_TARGET_FIELDS, Keys.GO_JSON)
        pairs.append((target["port"].string(), target["path"].string()))
    if scrape == "false":
        return None
    if not pairs:
        # Legacy form: a single endpoint from the top-level fields, with Istio's defaults.
        port, path = port or DEFAULT_PORT, path or DEFAULT_PATH
        pairs = [(port, path)]
        port_fields = ["port"]
    else:
        port, path = port or pairs[0][0], path or pairs[0][1]
        port_fields = [f"targets[{index}].port" for index in range(len(pairs))]
    targets = tuple(
        ScrapeTarget(port=_check_port(p, field, status_port), path=_normalise_path(pa))
        for (p, pa), field in zip(pairs, port_fields, strict=True)
    )
    return PrometheusTargets(targets=targets, scrape=scrape, port=port, path=path)
