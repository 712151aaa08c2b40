"""Probe configuration: one model of a check, read from the two documents that describe probes.

- ``ISTIO_KUBE_APP_PROBERS``: the kubelet probes the injector moved behind the status port
  (``/app-health/<container>/<kind>``), replayed by the agent against the application;
- ProxyConfig ``readinessProbe`` (written by a WorkloadGroup): the VM health check whose result the
  agent reports to istiod.

Both describe the same checks (``httpGet``, ``tcpSocket``, ``grpc``, ``exec``), so both become the
same :data:`Check` and are run by the same probers (``istio_agent.probe``). The parsers stay two
because Istio decodes the documents two ways: the app probers with Go's ``encoding/json``
(``pilot/cmd/pilot-agent/status/server.go``), the readiness probe with protojson as an Istio API
message (``networking.v1alpha3.ReadinessProbe``); each keeps its own defaults and error messages.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from istio_agent.config.document import Keys, Node, config_errors
from istio_agent.config.env import INT32_MAX, ConfigError, out_of_range

# --- the model ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HTTPGetCheck:
    """``httpGet``: GET ``scheme://host:port/path`` (``path`` always starts with ``/``).

    App probes dial the pod IP and send kubelet's own headers, so their ``host`` and ``headers`` are
    kept but unused, as in Istio; a VM check without ``host`` goes to the proxy's first IP.
    """

    port: int
    path: str = "/"
    host: str = ""
    scheme: str = "http"  # "http" or "https"
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def https(self) -> bool:
        return self.scheme == "https"


@dataclass(frozen=True)
class TCPCheck:
    """``tcpSocket``: a TCP connection opens (app probes ignore ``host`` and dial the pod IP)."""

    port: int
    host: str = ""


@dataclass(frozen=True)
class GRPCCheck:
    """``grpc``: ``grpc.health.v1.Health/Check`` for ``service`` (null means "") answers SERVING."""

    port: int
    service: str = ""


@dataclass(frozen=True)
class ExecCheck:
    """``exec``: the command exits 0 within the timeout (VM checks only; kubelet runs its own)."""

    command: tuple[str, ...]


Check = HTTPGetCheck | TCPCheck | GRPCCheck | ExecCheck


@dataclass(frozen=True)
class AppProber:
    """One ``ISTIO_KUBE_APP_PROBERS`` entry: a check and its timeout (0 = none)."""

    check: HTTPGetCheck | TCPCheck | GRPCCheck
    timeout_seconds: int = 0


DEFAULT_PERIOD_SECONDS = 10
DEFAULT_TIMEOUT_SECONDS = 1
DEFAULT_THRESHOLD = 1


@dataclass(frozen=True)
class ReadinessProbeConfig:
    """ProxyConfig ``readinessProbe`` with its defaults filled in; durations in seconds."""

    check: Check
    initial_delay: float = 0.0
    timeout: float = float(DEFAULT_TIMEOUT_SECONDS)
    period: float = float(DEFAULT_PERIOD_SECONDS)
    success_threshold: int = DEFAULT_THRESHOLD
    failure_threshold: int = DEFAULT_THRESHOLD


_HTTP_FIELDS = ("path", "port", "host", "scheme", "httpHeaders")


def _absolute(path: str) -> str:
    return path if path.startswith("/") else "/" + path


# --- ISTIO_KUBE_APP_PROBERS (Go encoding/json) -----------------------------------------------------

_APP_PREFIX = "invalid ISTIO_KUBE_APP_PROBERS: "
_APP_PATH = re.compile(r"/(app-health|app-lifecycle)/[^/]+/(livez|readyz|startupz|prestopz|poststartz)")
_APP_TYPE_ERROR = "invalid prober type, must be one of type httpGet, tcpSocket or gRPC"
_APP_DECODE_ERRORS = config_errors(f"{_APP_PREFIX}failed to decode app prober err = ")
_APP_PROBE_FIELDS = ("httpGet", "tcpSocket", "grpc", "timeoutSeconds")
_APP_HEADER_FIELDS = ("name", "value")


def parse_app_probers(text: str) -> dict[str, AppProber]:
    """Parse and validate ``ISTIO_KUBE_APP_PROBERS``; empty text means no probers.

    Field names match case-insensitively and unknown fields are ignored (Go's ``encoding/json``), so
    everything the injector writes is accepted; Istio's checks follow, so a broken value stops the
    agent at start-up rather than at the first probe. Error messages never quote the JSON: probe
    headers may carry credentials.
    """
    if not text.strip():
        return {}
    try:
        document = json.loads(text)
    except ValueError as err:
        # json.JSONDecodeError's message holds only a position, never the document.
        raise ConfigError(f"{_APP_PREFIX}failed to decode app prober err = {err}") from None
    if not isinstance(document, dict):
        Node(document, "", _APP_DECODE_ERRORS).expect("a map")
    probers: dict[str, AppProber] = {}
    for path, raw in document.items():
        if not isinstance(path, str) or not _APP_PATH.fullmatch(path):
            raise ConfigError(f"{_APP_PREFIX}invalid path: {path}")
        probers[path] = _app_prober(path, raw)
    return probers


def _go_int32(node: Node) -> int:
    """A Go ``int32`` field: a JSON integer; null is 0."""
    return 0 if node.is_null else node.integer(minimum=-(2**31), maximum=INT32_MAX)


def _int_or_string(node: Node) -> int | str:
    """Kubernetes IntOrString: a JSON integer or a string (validation refuses the string later)."""
    return node.value if isinstance(node.value, str) else _go_int32(node)


def _app_prober(path: str, raw: Any) -> AppProber:
    if raw is None:
        raise ConfigError(_APP_PREFIX + _APP_TYPE_ERROR)
    # Decoded first (null is the zero value), validated once the whole value has decoded.
    probe = Node(raw, path, _APP_DECODE_ERRORS).fields(_APP_PROBE_FIELDS, Keys.GO_JSON)
    timeout = _go_int32(probe["timeoutSeconds"])
    decoded: list[tuple[HTTPGetCheck | TCPCheck | GRPCCheck, int | str]] = []  # each check, its port
    if not probe["httpGet"].is_null:
        http = probe["httpGet"].fields(_HTTP_FIELDS, Keys.GO_JSON)
        headers = []
        for item in http["httpHeaders"].items():
            header = item.fields(_APP_HEADER_FIELDS, Keys.GO_JSON)
            headers.append((header["name"].string(), header["value"].string()))
        http_get = HTTPGetCheck(
            port=0,
            path=_absolute(http["path"].string()),
            host=http["host"].string(),
            scheme="https" if http["scheme"].string().upper() == "HTTPS" else "http",
            headers=tuple(headers),
        )
        decoded.append((http_get, _int_or_string(http["port"])))
    if not probe["tcpSocket"].is_null:
        tcp = probe["tcpSocket"].fields(("port", "host"), Keys.GO_JSON)
        decoded.append((TCPCheck(port=0, host=tcp["host"].string()), _int_or_string(tcp["port"])))
    if not probe["grpc"].is_null:
        rpc = probe["grpc"].fields(("port", "service"), Keys.GO_JSON)
        decoded.append((GRPCCheck(port=0, service=rpc["service"].string()), _go_int32(rpc["port"])))
    # Istio validates the key before the prober type; the caller already checked the key.
    if len(decoded) != 1:
        raise ConfigError(_APP_PREFIX + _APP_TYPE_ERROR)
    check, port = decoded[0]
    if isinstance(port, str):
        raise ConfigError(f"{_APP_PREFIX}invalid prober config for {path}, the port must be int type")
    problem = out_of_range(port, 1, 65535)
    if problem is not None:  # beyond Istio: a port Go would only fail on at probe time
        raise ConfigError(f"{_APP_PREFIX}invalid prober config for {path}, port {port}: {problem}")
    if timeout < 0:
        raise ConfigError(
            f"{_APP_PREFIX}invalid prober config for {path}, timeoutSeconds must not be negative"
        )
    return AppProber(check=dataclasses.replace(check, port=port), timeout_seconds=timeout)


# --- ProxyConfig readinessProbe (protojson) --------------------------------------------------------

# Each message's fields by their JSON names; protojson also takes their snake_case proto names.
_READINESS_FIELDS = (
    "httpGet",
    "tcpSocket",
    "grpc",
    "exec",
    "initialDelaySeconds",
    "timeoutSeconds",
    "periodSeconds",
    "successThreshold",
    "failureThreshold",
)
_ACTIONS = ("httpGet", "tcpSocket", "grpc", "exec")


def parse_readiness_probe(doc: dict[str, Any] | None) -> ReadinessProbeConfig | None:
    """The probe described by ``doc``, or ``None`` when there is none (health checking stays off).

    Both the camelCase names a WorkloadGroup writes and the proto's snake_case names are accepted, as
    protojson does. Defaults are Istio's (``pkg/istio-agent/health/health_check.go``); every bad
    field raises ``ConfigError`` naming ``readinessProbe.<field>`` so an operator finds the line.
    """
    if doc is None:
        return None
    root = Node(doc, "readinessProbe", config_errors())
    fields = root.fields(_READINESS_FIELDS, Keys.PROTOJSON)
    if not fields.set():
        return None  # `readinessProbe: {}` is an unset message in protojson
    present = [name for name in _ACTIONS if name in fields.set()]
    if not present:
        root.fail("one of httpGet, tcpSocket, grpc or exec is required")
    if len(present) > 1:
        root.fail(f"only one of httpGet, tcpSocket, grpc or exec may be set, got {present}")
    action = present[0]
    node = fields[action]
    check: Check
    if action == "httpGet":
        check = _http_get(node)
    elif action == "tcpSocket":
        tcp = node.fields(("port", "host"), Keys.PROTOJSON)
        check = TCPCheck(port=tcp["port"].port(lenient=True), host=tcp["host"].string())
    elif action == "grpc":
        rpc = node.fields(("port", "service"), Keys.PROTOJSON)
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
    path = _absolute(http["path"].string())
    if any(ch in path for ch in " \r\n\t"):
        http["path"].fail(f"must not contain whitespace, got {path!r}")
    headers: list[tuple[str, str]] = []
    for item in http["httpHeaders"].items():
        header = item.fields(("name", "value"), Keys.PROTOJSON)
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
    command = node.fields(("command",), Keys.PROTOJSON)["command"]
    if not isinstance(command.value, list) or not command.value:
        command.fail("expected a non-empty list of strings")
    args = command.strings()
    if not args[0]:
        command.element(0, args[0]).fail("the program must not be empty")
    return ExecCheck(command=args)
