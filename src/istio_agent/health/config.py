"""ProxyConfig ``readinessProbe`` (written by WorkloadGroup) parsed into a typed, defaulted probe config.

The document is the JSON form of Istio's ``networking.v1alpha3.ReadinessProbe``. Both the camelCase
names WorkloadGroup writes and the proto's snake_case names are accepted, as protojson does. Defaults
follow lifecycle.md §7; every bad field raises ``ConfigError`` naming ``readinessProbe.<field>`` so an
operator can find the offending line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from istio_agent.config.env import ConfigError

DEFAULT_PERIOD_SECONDS = 10
DEFAULT_TIMEOUT_SECONDS = 1
DEFAULT_THRESHOLD = 1
_INT32_MAX = 2**31 - 1
_ROOT = "readinessProbe"


@dataclass(frozen=True)
class HTTPGetCheck:
    """``httpGet``: healthy iff the GET answers a status in [200, 400)."""

    port: int
    path: str = "/"
    host: str = ""  # empty: the checker's default host (first proxy IP)
    scheme: str = "http"
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class TCPCheck:
    """``tcpSocket``: healthy iff a TCP connection opens."""

    port: int
    host: str = ""


@dataclass(frozen=True)
class GRPCCheck:
    """``grpc``: healthy iff ``grpc.health.v1.Health/Check`` answers SERVING."""

    port: int
    service: str = ""


@dataclass(frozen=True)
class ExecCheck:
    """``exec``: healthy iff the command exits 0 within the timeout."""

    command: tuple[str, ...]


HealthCheck = HTTPGetCheck | TCPCheck | GRPCCheck | ExecCheck


@dataclass(frozen=True)
class ReadinessProbeConfig:
    """A readiness probe with defaults filled in; durations in seconds."""

    check: HealthCheck
    initial_delay: float = 0.0
    timeout: float = float(DEFAULT_TIMEOUT_SECONDS)
    period: float = float(DEFAULT_PERIOD_SECONDS)
    success_threshold: int = DEFAULT_THRESHOLD
    failure_threshold: int = DEFAULT_THRESHOLD


# camelCase -> snake_case aliases accepted per object.
_PROBE_FIELDS = {
    "httpGet": "http_get",
    "tcpSocket": "tcp_socket",
    "grpc": "grpc",
    "exec": "exec",
    "initialDelaySeconds": "initial_delay_seconds",
    "timeoutSeconds": "timeout_seconds",
    "periodSeconds": "period_seconds",
    "successThreshold": "success_threshold",
    "failureThreshold": "failure_threshold",
}
_HTTP_FIELDS = {
    "path": "path",
    "port": "port",
    "host": "host",
    "scheme": "scheme",
    "httpHeaders": "http_headers",
}
_TCP_FIELDS = {"port": "port", "host": "host"}
_GRPC_FIELDS = {"port": "port", "service": "service"}
_EXEC_FIELDS = {"command": "command"}
_HEADER_FIELDS = {"name": "name", "value": "value"}
_ACTIONS = ("httpGet", "tcpSocket", "grpc", "exec")


def parse_readiness_probe(doc: dict[str, Any] | None) -> ReadinessProbeConfig | None:
    """The probe described by ``doc``, or ``None`` when there is none (health checking stays off)."""
    if doc is None:
        return None
    fields = _fields(doc, _ROOT, _PROBE_FIELDS)
    if not fields:
        return None  # `readinessProbe: {}` is an unset message in protojson
    present = [name for name in _ACTIONS if fields.get(name) is not None]
    if not present:
        raise ConfigError(f"{_ROOT}: one of httpGet, tcpSocket, grpc or exec is required")
    if len(present) > 1:
        raise ConfigError(f"{_ROOT}: only one of httpGet, tcpSocket, grpc or exec may be set, got {present}")
    action = present[0]
    where = f"{_ROOT}.{action}"
    check: HealthCheck
    if action == "httpGet":
        check = _http_get(fields[action], where)
    elif action == "tcpSocket":
        tcp = _fields(fields[action], where, _TCP_FIELDS)
        check = TCPCheck(port=_port(tcp.get("port"), where), host=_string(tcp.get("host"), f"{where}.host"))
    elif action == "grpc":
        rpc = _fields(fields[action], where, _GRPC_FIELDS)
        check = GRPCCheck(
            port=_port(rpc.get("port"), where), service=_string(rpc.get("service"), f"{where}.service")
        )
    else:
        check = _exec(fields[action], where)
    return ReadinessProbeConfig(
        check=check,
        initial_delay=float(_count(fields, "initialDelaySeconds") or 0),
        timeout=float(_count(fields, "timeoutSeconds") or DEFAULT_TIMEOUT_SECONDS),
        period=float(_count(fields, "periodSeconds") or DEFAULT_PERIOD_SECONDS),
        success_threshold=_count(fields, "successThreshold") or DEFAULT_THRESHOLD,
        failure_threshold=_count(fields, "failureThreshold") or DEFAULT_THRESHOLD,
    )


def _fields(value: Any, where: str, names: dict[str, str]) -> dict[str, Any]:
    """The object's fields keyed by camelCase name; unknown or duplicated fields are errors."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected an object, got {type(value).__name__}")
    aliases = {snake: camel for camel, snake in names.items()}
    out: dict[str, Any] = {}
    for key, item in value.items():
        name = key if key in names else aliases.get(key) if isinstance(key, str) else None
        if name is None:
            raise ConfigError(f"{where}.{key}: unknown field")
        if name in out:
            raise ConfigError(f"{where}.{name}: set twice (as {name} and {names[name]})")
        out[name] = item
    return out


def _integer(value: Any, where: str) -> int:
    """A protojson integer: a JSON number without fraction, or a decimal string."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip(), 10)
        except ValueError:
            pass
    raise ConfigError(f"{where}: expected an integer, got {value!r}")


def _count(fields: dict[str, Any], name: str) -> int:
    """A non-negative int32 field (0 or absent means "use the default")."""
    value = fields.get(name)
    if value is None:
        return 0
    number = _integer(value, f"{_ROOT}.{name}")
    if not 0 <= number <= _INT32_MAX:
        raise ConfigError(f"{_ROOT}.{name}: must be between 0 and {_INT32_MAX}, got {number}")
    return number


def _port(value: Any, where: str) -> int:
    if value is None:
        raise ConfigError(f"{where}.port: required")
    port = _integer(value, f"{where}.port")
    if not 1 <= port <= 65535:
        raise ConfigError(f"{where}.port: must be between 1 and 65535, got {port}")
    return port


def _string(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {type(value).__name__}")
    return value


def _http_get(value: Any, where: str) -> HTTPGetCheck:
    http = _fields(value, where, _HTTP_FIELDS)
    path = _string(http.get("path"), f"{where}.path") or "/"
    if not path.startswith("/"):
        path = "/" + path
    if any(ch in path for ch in " \r\n\t"):
        raise ConfigError(f"{where}.path: must not contain whitespace, got {path!r}")
    scheme = (_string(http.get("scheme"), f"{where}.scheme") or "http").lower()
    if scheme not in ("http", "https"):
        raise ConfigError(f"{where}.scheme: must be http or https, got {scheme!r}")
    headers: list[tuple[str, str]] = []
    raw_headers = http.get("httpHeaders") or []
    if not isinstance(raw_headers, list):
        raise ConfigError(f"{where}.httpHeaders: expected a list, got {type(raw_headers).__name__}")
    for index, raw in enumerate(raw_headers):
        at = f"{where}.httpHeaders[{index}]"
        header = _fields(raw, at, _HEADER_FIELDS)
        name = _string(header.get("name"), f"{at}.name")
        header_value = _string(header.get("value"), f"{at}.value")
        if not name or any(ch in name for ch in " :\r\n\t"):
            raise ConfigError(f"{at}.name: not a valid header name: {name!r}")
        if "\r" in header_value or "\n" in header_value:
            raise ConfigError(f"{at}.value: must not contain line breaks")
        headers.append((name, header_value))
    host = _string(http.get("host"), f"{where}.host")
    return HTTPGetCheck(
        port=_port(http.get("port"), where), path=path, host=host, scheme=scheme, headers=tuple(headers)
    )


def _exec(value: Any, where: str) -> ExecCheck:
    fields = _fields(value, where, _EXEC_FIELDS)
    command = fields.get("command")
    if not isinstance(command, list) or not command:
        raise ConfigError(f"{where}.command: expected a non-empty list of strings")
    for index, arg in enumerate(command):
        if not isinstance(arg, str):
            raise ConfigError(f"{where}.command[{index}]: expected a string, got {type(arg).__name__}")
    if not command[0]:
        raise ConfigError(f"{where}.command[0]: the program must not be empty")
    return ExecCheck(command=tuple(command))
