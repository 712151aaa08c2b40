"""ISTIO_KUBE_APP_PROBERS parsing and validation (Istio's status server cases)."""

from __future__ import annotations

import json

import pytest

from istio_agent.config import ConfigError
from istio_agent.config.app_probers import (
    AppProber,
    GRPCProber,
    HTTPGetProber,
    TCPSocketProber,
    parse_app_probers,
)

PREFIX = "invalid ISTIO_KUBE_APP_PROBERS: "


def parse(document: object) -> dict[str, AppProber]:
    return parse_app_probers(json.dumps(document))


def error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_app_probers(text)
    message = str(info.value)
    assert message.startswith(PREFIX)
    return message[len(PREFIX) :]


@pytest.mark.parametrize("text", ["", "  ", "{}"])
def test_empty_is_valid(text: str) -> None:
    assert parse_app_probers(text) == {}


def test_valid_http_tcp_grpc() -> None:
    probers = parse(
        {
            "/app-health/web/readyz": {
                "httpGet": {
                    "path": "/ready",
                    "port": 8080,
                    "scheme": "HTTPS",
                    "host": "ignored",
                    "httpHeaders": [{"name": "X-A", "value": "1"}],
                },
                "timeoutSeconds": 3,
                "initialDelaySeconds": 7,
            },
            "/app-health/web/livez": {"tcpSocket": {"port": 8081}},
            "/app-health/web/startupz": {"grpc": {"port": 9090, "service": "svc"}},
            "/app-lifecycle/web/prestopz": {"httpGet": {"path": "stop", "port": 8080}},
        }
    )
    assert probers["/app-health/web/readyz"] == AppProber(
        HTTPGetProber(port=8080, path="/ready", scheme="HTTPS", host="ignored", headers=(("X-A", "1"),)), 3
    )
    assert probers["/app-health/web/readyz"].action.https  # type: ignore[union-attr]
    assert probers["/app-health/web/livez"] == AppProber(TCPSocketProber(port=8081), 0)
    assert probers["/app-health/web/startupz"] == AppProber(GRPCProber(port=9090, service="svc"), 0)
    assert probers["/app-lifecycle/web/prestopz"].action == HTTPGetProber(port=8080, path="stop")


def test_keys_case_insensitive() -> None:
    probers = parse(
        {
            "/app-health/a/livez": {"gRPC": {"PORT": 9090, "Service": None}, "TimeoutSeconds": 2},
            "/app-health/a/readyz": {"HTTPGET": {"Path": "/x", "pOrt": 80}},
            "/app-health/a/startupz": {"TcpSocket": {"port": 81}},
        }
    )
    assert probers["/app-health/a/livez"] == AppProber(GRPCProber(port=9090, service=""), 2)
    assert probers["/app-health/a/readyz"].action == HTTPGetProber(port=80, path="/x")
    assert probers["/app-health/a/startupz"].action == TCPSocketProber(port=81)


def test_null_service() -> None:
    assert parse({"/app-health/a/livez": {"grpc": {"port": 1, "service": None}}})[
        "/app-health/a/livez"
    ].action == GRPCProber(port=1, service="")


@pytest.mark.parametrize(
    "path",
    [
        "/foo/bar",
        "app-health/a/livez",
        "/app-health/a/unknown",
        "/app-health//livez",
        "/app-health/a/b/livez",
        "/app-health/a/livez/",
        "/app-health/a/livez\n",
        "/app-lifecycle/a/stopz",
    ],
)
def test_invalid_path(path: str) -> None:
    assert error(json.dumps({path: {"tcpSocket": {"port": 1}}})) == f"invalid path: {path}"


@pytest.mark.parametrize(
    "prober",
    [
        {},
        {"timeoutSeconds": 1},
        {"exec": {"command": ["true"]}},
        {"httpGet": {"port": 1}, "tcpSocket": {"port": 1}},
        {"tcpSocket": {"port": 1}, "grpc": {"port": 1}},
        {"httpGet": None},
        None,
    ],
)
def test_invalid_prober_type(prober: object) -> None:
    assert (
        error(json.dumps({"/app-health/a/readyz": prober}))
        == "invalid prober type, must be one of type httpGet, tcpSocket or gRPC"
    )


@pytest.mark.parametrize("kind", ["httpGet", "tcpSocket"])
def test_string_port_rejected(kind: str) -> None:
    message = error(json.dumps({"/app-health/a/readyz": {kind: {"port": "http"}}}))
    assert message == "invalid prober config for /app-health/a/readyz, the port must be int type"


def test_grpc_string_port_is_decode_error() -> None:
    assert error(json.dumps({"/app-health/a/readyz": {"grpc": {"port": "9090"}}})).startswith(
        "failed to decode app prober"
    )


@pytest.mark.parametrize(
    "text",
    [
        "{",
        "[]",
        "not json",
        '{"/app-health/a/readyz": 5}',
        '{"/app-health/a/readyz": {"httpGet": {"port": 1.5}}}',
        '{"/app-health/a/readyz": {"httpGet": {"port": 1, "path": 3}}}',
        '{"/app-health/a/readyz": {"tcpSocket": {"port": 1}, "timeoutSeconds": "1"}}',
        '{"/app-health/a/readyz": {"httpGet": {"port": 1, "httpHeaders": {"a": "b"}}}}',
        '{"/app-health/a/readyz": {"tcpSocket": {"port": true}}}',
    ],
)
def test_decode_errors(text: str) -> None:
    assert error(text).startswith("failed to decode app prober err = ")


@pytest.mark.parametrize("port", [0, 70000, -1])
def test_port_out_of_range(port: int) -> None:
    assert "out of range" in error(json.dumps({"/app-health/a/readyz": {"tcpSocket": {"port": port}}}))


def test_negative_timeout_rejected() -> None:
    message = error(json.dumps({"/app-health/a/readyz": {"tcpSocket": {"port": 1}, "timeoutSeconds": -1}}))
    assert "timeoutSeconds" in message


def test_errors_do_not_quote_headers() -> None:
    secret = "Bearer s3cr3t-token"
    text = json.dumps(
        {
            "/app-health/a/readyz": {
                "httpGet": {"port": "x", "httpHeaders": [{"name": "Authorization", "value": secret}]}
            }
        }
    )
    assert secret not in error(text)
    assert secret not in error(text[:-1])
