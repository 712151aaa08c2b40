"""Probe configuration: ISTIO_KUBE_APP_PROBERS (Istio's status server cases) and ProxyConfig readinessProbe."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from istio_agent.config import ConfigError
from istio_agent.config.probes import (
    AppProber,
    ExecCheck,
    GRPCCheck,
    HTTPGetCheck,
    ReadinessProbeConfig,
    TCPCheck,
    parse_app_probers,
    parse_readiness_probe,
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
        HTTPGetCheck(port=8080, path="/ready", scheme="https", host="ignored", headers=(("X-A", "1"),)), 3
    )
    assert probers["/app-health/web/readyz"].check.https  # type: ignore[union-attr]
    assert probers["/app-health/web/livez"] == AppProber(TCPCheck(port=8081), 0)
    assert probers["/app-health/web/startupz"] == AppProber(GRPCCheck(port=9090, service="svc"), 0)
    assert probers["/app-lifecycle/web/prestopz"].check == HTTPGetCheck(port=8080, path="/stop")


def test_keys_case_insensitive() -> None:
    probers = parse(
        {
            "/app-health/a/livez": {"gRPC": {"PORT": 9090, "Service": None}, "TimeoutSeconds": 2},
            "/app-health/a/readyz": {"HTTPGET": {"Path": "/x", "pOrt": 80}},
            "/app-health/a/startupz": {"TcpSocket": {"port": 81}},
        }
    )
    assert probers["/app-health/a/livez"] == AppProber(GRPCCheck(port=9090, service=""), 2)
    assert probers["/app-health/a/readyz"].check == HTTPGetCheck(port=80, path="/x")
    assert probers["/app-health/a/startupz"].check == TCPCheck(port=81)


def test_null_service() -> None:
    assert parse({"/app-health/a/livez": {"grpc": {"port": 1, "service": None}}})[
        "/app-health/a/livez"
    ].check == GRPCCheck(port=1, service="")


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
    assert "must be between 1 and 65535" in error(
        json.dumps({"/app-health/a/readyz": {"tcpSocket": {"port": port}}})
    )


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


# --- ProxyConfig readinessProbe ------------------------------------------------------------------


def test_absent_or_empty_means_no_health_checking() -> None:
    assert parse_readiness_probe(None) is None
    assert parse_readiness_probe({}) is None


def test_defaults() -> None:
    config = parse_readiness_probe({"httpGet": {"port": 8080}})
    assert config == ReadinessProbeConfig(
        check=HTTPGetCheck(port=8080, path="/", host="", scheme="http", headers=()),
        initial_delay=0.0,
        timeout=1.0,
        period=10.0,
        success_threshold=1,
        failure_threshold=1,
    )


def test_zero_values_take_defaults() -> None:
    config = parse_readiness_probe(
        {
            "tcpSocket": {"port": 80},
            "timeoutSeconds": 0,
            "periodSeconds": 0,
            "successThreshold": 0,
            "failureThreshold": 0,
        }
    )
    assert config is not None
    assert (config.timeout, config.period, config.success_threshold, config.failure_threshold) == (
        1,
        10,
        1,
        1,
    )


def test_workloadgroup_yaml() -> None:
    doc = yaml.safe_load(
        """
        initialDelaySeconds: 5
        timeoutSeconds: 3
        periodSeconds: 4
        successThreshold: 3
        failureThreshold: 3
        httpGet:
          path: ready
          port: "8080"
          host: 10.0.0.5
          scheme: HTTPS
          httpHeaders:
          - name: Host
            value: app.example
          - name: X-Token
            value: abc
        """
    )
    config = parse_readiness_probe(doc)
    assert config == ReadinessProbeConfig(
        check=HTTPGetCheck(
            port=8080,
            path="/ready",
            host="10.0.0.5",
            scheme="https",
            headers=(("Host", "app.example"), ("X-Token", "abc")),
        ),
        initial_delay=5.0,
        timeout=3.0,
        period=4.0,
        success_threshold=3,
        failure_threshold=3,
    )


@pytest.mark.parametrize(
    ("doc", "check"),
    [
        ({"tcpSocket": {"port": 3306, "host": "db"}}, TCPCheck(port=3306, host="db")),
        ({"tcp_socket": {"port": 3306}}, TCPCheck(port=3306)),
        ({"grpc": {"port": 9000, "service": "svc"}}, GRPCCheck(port=9000, service="svc")),
        ({"grpc": {"port": 9000}}, GRPCCheck(port=9000)),
        ({"exec": {"command": ["cat", "/tmp/ready"]}}, ExecCheck(("cat", "/tmp/ready"))),
        (
            {"http_get": {"port": 1, "http_headers": [{"name": "a", "value": "b"}]}},
            HTTPGetCheck(1, headers=(("a", "b"),)),
        ),
    ],
)
def test_actions(doc: dict[str, Any], check: object) -> None:
    config = parse_readiness_probe(doc)
    assert config is not None and config.check == check


def test_snake_case_timing_fields() -> None:
    config = parse_readiness_probe(
        {"exec": {"command": ["true"]}, "period_seconds": 2, "initial_delay_seconds": "7"}
    )
    assert config is not None and config.period == 2.0 and config.initial_delay == 7.0


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "readinessProbe: expected a map"),
        ({"periodSeconds": 5}, "readinessProbe: one of httpGet, tcpSocket, grpc or exec is required"),
        ({"httpGet": {"port": 1}, "exec": {"command": ["x"]}}, "readinessProbe: only one of"),
        ({"tcpSocket": {"port": 1}, "bogus": 1}, "readinessProbe.bogus: unknown field"),
        (
            {"tcpSocket": {"port": 1}, "periodSeconds": 1, "period_seconds": 2},
            "readinessProbe.periodSeconds: set twice",
        ),
        ({"tcpSocket": {}}, "readinessProbe.tcpSocket.port: required"),
        ({"tcpSocket": {"port": 0}}, "readinessProbe.tcpSocket.port: must be between 1 and 65535"),
        ({"tcpSocket": {"port": 70000}}, "readinessProbe.tcpSocket.port: must be between 1 and 65535"),
        ({"tcpSocket": {"port": "http"}}, "readinessProbe.tcpSocket.port: expected an integer"),
        ({"tcpSocket": {"port": True}}, "readinessProbe.tcpSocket.port: expected an integer"),
        ({"tcpSocket": {"port": 1, "host": 5}}, "readinessProbe.tcpSocket.host: expected a string"),
        ({"tcpSocket": "x"}, "readinessProbe.tcpSocket: expected a map"),
        ({"grpc": {"port": 1, "service": ["a"]}}, "readinessProbe.grpc.service: expected a string"),
        (
            {"httpGet": {"port": 1, "scheme": "ftp"}},
            "readinessProbe.httpGet.scheme: must be one of http, https",
        ),
        (
            {"httpGet": {"port": 1, "path": "/a b"}},
            "readinessProbe.httpGet.path: must not contain whitespace",
        ),
        (
            {"httpGet": {"port": 1, "httpHeaders": {"a": "b"}}},
            "readinessProbe.httpGet.httpHeaders: expected a list",
        ),
        (
            {"httpGet": {"port": 1, "httpHeaders": [{"name": ""}]}},
            "readinessProbe.httpGet.httpHeaders[0].name",
        ),
        (
            {"httpGet": {"port": 1, "httpHeaders": [{"name": "a:b"}]}},
            "readinessProbe.httpGet.httpHeaders[0].name",
        ),
        (
            {"httpGet": {"port": 1, "httpHeaders": [{"name": "a", "value": "x\r\nEvil: 1"}]}},
            "readinessProbe.httpGet.httpHeaders[0].value: must not contain line breaks",
        ),
        (
            {"httpGet": {"port": 1, "httpHeaders": [{"name": "a", "nope": 1}]}},
            "readinessProbe.httpGet.httpHeaders[0].nope",
        ),
        ({"exec": {"command": []}}, "readinessProbe.exec.command: expected a non-empty list"),
        ({"exec": {"command": "true"}}, "readinessProbe.exec.command: expected a non-empty list"),
        ({"exec": {"command": ["true", 1]}}, "readinessProbe.exec.command[1]: expected a string"),
        ({"exec": {"command": [""]}}, "readinessProbe.exec.command[0]: the program must not be empty"),
        (
            {"exec": {"command": ["true"]}, "periodSeconds": -1},
            "readinessProbe.periodSeconds: must be between 0",
        ),
        (
            {"exec": {"command": ["true"]}, "timeoutSeconds": 1.5},
            "readinessProbe.timeoutSeconds: expected an integer",
        ),
        (
            {"exec": {"command": ["true"]}, "failureThreshold": 2**31},
            "readinessProbe.failureThreshold: must be between",
        ),
    ],
)
def test_errors_name_the_field(doc: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_readiness_probe(doc)
    assert str(info.value).startswith(message), str(info.value)


# --- one model -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "doc",
    [
        {"httpGet": {"path": "ready", "port": 8080, "scheme": "HTTPS"}},
        {"httpGet": {"port": 8080, "host": "10.0.0.5", "httpHeaders": [{"name": "X-A", "value": "1"}]}},
        {"tcpSocket": {"port": 3306}},
        {"grpc": {"port": 9000, "service": "svc"}},
    ],
)
def test_both_documents_give_the_same_check(doc: dict[str, Any]) -> None:
    app = parse({"/app-health/a/readyz": doc})["/app-health/a/readyz"]
    readiness = parse_readiness_probe(doc)
    assert readiness is not None
    assert app.check == readiness.check
