"""``ISTIO_KUBE_APP_PROBERS``: the application probes the injector moved behind the status port.

The injector rewrites each container probe to ``httpGet :15020/app-health/<container>/<kind>`` and
records the original probe here as JSON; the agent replays it against the application. The JSON
is decoded the way Go's ``encoding/json`` does it for Istio (field names match case-insensitively,
unknown fields are ignored) so that everything the injector writes is accepted, and validated with
Istio's messages so that a broken value stops the agent at startup rather than at the first probe.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

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


class _DecodeError(Exception):
    """A value of the wrong JSON type (Go: json.Unmarshal error)."""


def _fields(obj: Any, where: str) -> dict[str, Any]:
    """Lower-case the keys of a JSON object, last duplicate winning (Go's case-insensitive match)."""
    if not isinstance(obj, dict):
        raise _DecodeError(f"{where}: expected an object, got {_kind(obj)}")
    return {str(key).lower(): value for key, value in obj.items()}


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _string(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _DecodeError(f"{where}: expected a string, got {_kind(value)}")
    return value


def _int(value: Any, where: str) -> int:
    if value is None:
        return 0
    if not _is_int(value):
        raise _DecodeError(f"{where}: expected an integer, got {_kind(value)}")
    if not -(2**31) <= value < 2**31:
        raise _DecodeError(f"{where}: {value} overflows int32")
    return int(value)


def _int_or_string_port(value: Any, where: str) -> int | str:
    """Kubernetes IntOrString: a JSON integer or string (validation later rejects the string)."""
    if isinstance(value, str):
        return value
    return _int(value, where)


def _headers(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _DecodeError(f"{where}: expected an array, got {_kind(value)}")
    out = []
    for index, item in enumerate(value):
        fields = _fields(item, f"{where}[{index}]")
        out.append(
            (
                _string(fields.get("name"), f"{where}[{index}].name"),
                _string(fields.get("value"), f"{where}[{index}].value"),
            )
        )
    return tuple(out)


def _check_port(port: int | str, path: str) -> int:
    if isinstance(port, str):
        raise ConfigError(f"{_PREFIX}invalid prober config for {path}, the port must be int type")
    if not 1 <= port <= 65535:  # beyond Istio: a port Go would only fail on at probe time
        raise ConfigError(f"{_PREFIX}invalid prober config for {path}, port {port} out of range 1-65535")
    return port


def _parse_one(path: str, raw: Any) -> AppProber:
    if raw is None:
        raise ConfigError(_PREFIX + _TYPE_ERROR)
    fields = _fields(raw, path)
    timeout = _int(fields.get("timeoutseconds"), f"{path}.timeoutSeconds")
    actions: list[ProberAction] = []
    http_raw = fields.get("httpget")
    tcp_raw = fields.get("tcpsocket")
    grpc_raw = fields.get("grpc")
    http_port: int | str | None = None
    tcp_port: int | str | None = None
    if http_raw is not None:
        http = _fields(http_raw, f"{path}.httpGet")
        http_port = _int_or_string_port(http.get("port"), f"{path}.httpGet.port")
        actions.append(
            HTTPGetProber(
                port=0,
                path=_string(http.get("path"), f"{path}.httpGet.path"),
                scheme=_string(http.get("scheme"), f"{path}.httpGet.scheme") or "HTTP",
                host=_string(http.get("host"), f"{path}.httpGet.host"),
                headers=_headers(http.get("httpheaders"), f"{path}.httpGet.httpHeaders"),
            )
        )
    if tcp_raw is not None:
        tcp = _fields(tcp_raw, f"{path}.tcpSocket")
        tcp_port = _int_or_string_port(tcp.get("port"), f"{path}.tcpSocket.port")
        actions.append(TCPSocketProber(port=0, host=_string(tcp.get("host"), f"{path}.tcpSocket.host")))
    if grpc_raw is not None:
        grpc = _fields(grpc_raw, f"{path}.grpc")
        actions.append(
            GRPCProber(
                port=_int(grpc.get("port"), f"{path}.grpc.port"),
                service=_string(grpc.get("service"), f"{path}.grpc.service"),
            )
        )
    # Istio validates the key before the prober type; the caller already checked the key.
    if len(actions) != 1:
        raise ConfigError(_PREFIX + _TYPE_ERROR)
    action = actions[0]
    if isinstance(action, HTTPGetProber):
        assert http_port is not None
        action = HTTPGetProber(
            port=_check_port(http_port, path),
            path=action.path,
            scheme=action.scheme,
            host=action.host,
            headers=action.headers,
        )
    elif isinstance(action, TCPSocketProber):
        assert tcp_port is not None
        action = TCPSocketProber(port=_check_port(tcp_port, path), host=action.host)
    elif not 1 <= action.port <= 65535:
        raise ConfigError(
            f"{_PREFIX}invalid prober config for {path}, port {action.port} out of range 1-65535"
        )
    if timeout < 0:
        raise ConfigError(f"{_PREFIX}invalid prober config for {path}, timeoutSeconds must not be negative")
    return AppProber(action=action, timeout_seconds=timeout)


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
        raise ConfigError(
            f"{_PREFIX}failed to decode app prober err = expected an object, got {_kind(document)}"
        )
    probers: dict[str, AppProber] = {}
    for path, raw in document.items():
        if not isinstance(path, str) or not _PATH.fullmatch(path):
            raise ConfigError(f"{_PREFIX}invalid path: {path}")
        try:
            probers[path] = _parse_one(path, raw)
        except _DecodeError as err:
            raise ConfigError(f"{_PREFIX}failed to decode app prober err = {err}") from None
    return probers
