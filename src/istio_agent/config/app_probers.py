"""``ISTIO_KUBE_APP_PROBERS``: the application probes the injector moved behind the status port.

The injector rewrites each container probe to ``httpGet :15020/app-health/<container>/<kind>`` and
records the original probe here as JSON; the agent replays it against the application. The JSON
is decoded the way Go's ``encoding/json`` does it for Istio (field names match case-insensitively,
unknown fields are ignored) so that everything the injector writes is accepted, and validated with
Istio's messages so that a broken value stops the agent at startup rather than at the first probe.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from istio_agent.config.document import INT32_MAX, Keys, Node, config_errors
from istio_agent.config.env import ConfigError

_PREFIX = "invalid ISTIO_KUBE_APP_PROBERS: "
_PATH = re.compile(r"/(app-health|app-lifecycle)/[^/]+/(livez|readyz|startupz|prestopz|poststartz)")
_TYPE_ERROR = "invalid prober type, must be one of type httpGet, tcpSocket or gRPC"


@dataclass(frozen=True)
class HTTPGetProber:
    """An ``httpGet`` probe; ``host`` and ``headers`` are kept but unused (kubelet sends the headers)."""

    port: int
    path: str = "/"
    scheme: str = "HTTP"
    host: str = ""
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def https(self) -> bool:
        return self.scheme.upper() == "HTTPS"


@dataclass(frozen=True)
class TCPSocketProber:
    """A ``tcpSocket`` probe; ``host`` is ignored, the agent always dials the pod IP."""

    port: int
    host: str = ""


@dataclass(frozen=True)
class GRPCProber:
    """A ``grpc`` probe: ``grpc.health.v1.Health/Check`` for ``service`` (null means "")."""

    port: int
    service: str = ""


ProberAction = HTTPGetProber | TCPSocketProber | GRPCProber


@dataclass(frozen=True)
class AppProber:
    """One recorded probe and its timeout (0 = none)."""

    action: ProberAction
    timeout_seconds: int = 0


_DECODE_ERRORS = config_errors(f"{_PREFIX}failed to decode app prober err = ")
_PROBE_FIELDS = ("httpGet", "tcpSocket", "grpc", "timeoutSeconds")
_HTTP_FIELDS = ("path", "port", "scheme", "host", "httpHeaders")
_TCP_FIELDS = ("port", "host")
_GRPC_FIELDS = ("port", "service")
_HEADER_FIELDS = ("name", "value")


def _int32(node: Node) -> int:
    """A Go ``int32`` field: a JSON integer; null is 0."""
    return 0 if node.is_null else node.integer(minimum=-(2**31), maximum=INT32_MAX)


def _int_or_string(node: Node) -> int | str:
    """Kubernetes IntOrString: a JSON integer or a string (validation refuses the string later)."""
    return node.value if isinstance(node.value, str) else _int32(node)


def _header(node: Node) -> tuple[str, str]:
    header = node.fields(_HEADER_FIELDS, Keys.GO_JSON)
    return header["name"].string(), header["value"].string()


def _parse_one(path: str, raw: Any) -> AppProber:
    if raw is None:
        raise ConfigError(_PREFIX + _TYPE_ERROR)
    # Decoded as Go's encoding/json decodes it for Istio (keys match case-insensitively, unknown keys
    # are ignored, null is the zero value); the probe is validated once the whole value has decoded.
    probe = Node(raw, path, _DECODE_ERRORS).fields(_PROBE_FIELDS, Keys.GO_JSON)
    timeout = _int32(probe["timeoutSeconds"])
    decoded: list[tuple[ProberAction, int | str]] = []  # each action given, with its port as decoded
    if not probe["httpGet"].is_null:
        http = probe["httpGet"].fields(_HTTP_FIELDS, Keys.GO_JSON)
        http_get = HTTPGetProber(
            port=0,
            path=http["path"].string(),
            scheme=http["scheme"].string() or "HTTP",
            host=http["host"].string(),
            headers=tuple(_header(item) for item in http["httpHeaders"].items()),
        )
        decoded.append((http_get, _int_or_string(http["port"])))
    if not probe["tcpSocket"].is_null:
        tcp = probe["tcpSocket"].fields(_TCP_FIELDS, Keys.GO_JSON)
        decoded.append((TCPSocketProber(port=0, host=tcp["host"].string()), _int_or_string(tcp["port"])))
    if not probe["grpc"].is_null:
        rpc = probe["grpc"].fields(_GRPC_FIELDS, Keys.GO_JSON)
        decoded.append((GRPCProber(port=0, service=rpc["service"].string()), _int32(rpc["port"])))
    # Istio validates the key before the prober type; the caller already checked the key.
    if len(decoded) != 1:
        raise ConfigError(_PREFIX + _TYPE_ERROR)
    action, port = decoded[0]
    if isinstance(port, str):
        raise ConfigError(f"{_PREFIX}invalid prober config for {path}, the port must be int type")
    if not 1 <= port <= 65535:  # beyond Istio: a port Go would only fail on at probe time
        raise ConfigError(f"{_PREFIX}invalid prober config for {path}, port {port} out of range 1-65535")
    if timeout < 0:
        raise ConfigError(f"{_PREFIX}invalid prober config for {path}, timeoutSeconds must not be negative")
    return AppProber(action=dataclasses.replace(action, port=port), timeout_seconds=timeout)


def parse_app_probers(text: str) -> dict[str, AppProber]:
    """Parse and validate ``ISTIO_KUBE_APP_PROBERS``; empty text means no probers.

    Error messages never quote the JSON: probe headers may carry credentials.
    """
    if not text.strip():
        return {}
    try:
        document = json.loads(text)
    except ValueError as err:
        # json.JSONDecodeError's message holds only a position, never the document.
        raise ConfigError(f"{_PREFIX}failed to decode app prober err = {err}") from None
    if not isinstance(document, dict):
        Node(document, "", _DECODE_ERRORS).expect("a map")
    probers: dict[str, AppProber] = {}
    for path, raw in document.items():
        if not isinstance(path, str) or not _PATH.fullmatch(path):
            raise ConfigError(f"{_PREFIX}invalid path: {path}")
        probers[path] = _parse_one(path, raw)
    return probers
