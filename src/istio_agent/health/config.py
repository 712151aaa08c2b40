"""ProxyConfig ``readinessProbe`` (written by WorkloadGroup) parsed into a typed, defaulted probe config.

The document is the JSON form of Istio's ``networking.v1alpha3.ReadinessProbe``. Both the camelCase
names WorkloadGroup writes and the proto's snake_case names are accepted, as protojson does. Defaults
follow lifecycle.md §7; every bad field raises ``ConfigError`` naming ``readinessProbe.<field>`` so an
operator can find the offending line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from istio_agent.config.document import INT32_MAX, Keys, Node, config_errors

DEFAULT_PERIOD_SECONDS = 10
DEFAULT_TIMEOUT_SECONDS = 1
DEFAULT_THRESHOLD = 1
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
    root = Node(doc, _ROOT, config_errors())
    fields = root.fields(_PROBE_FIELDS, Keys.PROTOJSON)
    if not fields.set():
        return None  # `readinessProbe: {}` is an unset message in protojson
    present = [name for name in _ACTIONS if name in fields.set()]
    if not present:
        root.fail("one of httpGet, tcpSocket, grpc or exec is required")
    if len(present) > 1:
        root.fail(f"only one of httpGet, tcpSocket, grpc or exec may be set, got {present}")
    action = present[0]
    node = fields[action]
    check: HealthCheck
    if action == "httpGet":
        check = _http_get(node)
    elif action == "tcpSocket":
        tcp = node.fields(_TCP_FIELDS, Keys.PROTOJSON)
        check = TCPCheck(port=tcp["port"].port(lenient=True), host=tcp["host"].string())
    elif action == "grpc":
        rpc = node.fields(_GRPC_FIELDS, Keys.PROTOJSON)
        check = GRPCCheck(port=rpc["port"].port(lenient=True), service=rpc["service"].string())
    else:
        check = _exec(node)
    return ReadinessProbeConfig(
        check=check,
        initial_delay=float(_count(fields["initialDelaySeconds"]) or 0),
        timeout=float(_count(fields["timeoutSeconds"]) or DEFAULT_TIMEOUT_SECONDS),
        period=float(_count(fields["periodSeconds"]) or DEFAULT_PERIOD_SECONDS),
        success_threshold=_count(fields["successThreshold"]) or DEFAULT_THRESHOLD,
        failure_threshold=_count(fields["failureThreshold"]) or DEFAULT_THRESHOLD,
    )


def _count(node: Node) -> int:
    """A non-negative int32 field (0 or absent means "use the default")."""
    return 0 if node.is_null else node.integer(minimum=0, maximum=INT32_MAX, lenient=True)


def _http_get(node: Node) -> HTTPGetCheck:
    http = node.fields(_HTTP_FIELDS, Keys.PROTOJSON)
    path = http["path"].string() or "/"
    if not path.startswith("/"):
        path = "/" + path
    if any(ch in path for ch in " \r\n\t"):
        http["path"].fail(f"must not contain whitespace, got {path!r}")
    headers: list[tuple[str, str]] = []
    for item in http["httpHeaders"].items():
        header = item.fields(_HEADER_FIELDS, Keys.PROTOJSON)
        name, value = header["name"].string(), header["value"].string()
        if not name or any(ch in name for ch in " :\r\n\t"):
            header["name"].fail(f"not a valid header name: {name!r}")
        if "\r" in value or "\n" in value:
            header["value"].fail("must not contain line breaks")
        headers.append((name, value))
    scheme = http["scheme"]
    return HTTPGetCheck(
        port=http["port"].port(lenient=True),
        path=path,
        host=http["host"].string(),
        scheme=scheme.choice(("http", "https"), fold=str.lower) if scheme.string() else "http",
        headers=tuple(headers),
    )


def _exec(node: Node) -> ExecCheck:
    command = node.fields(_EXEC_FIELDS, Keys.PROTOJSON)["command"]
    if not isinstance(command.value, list) or not command.value:
        command.fail("expected a non-empty list of strings")
    args = command.strings()
    if not args[0]:
        command.element(0, args[0]).fail("the program must not be empty")
    return ExecCheck(command=args)
