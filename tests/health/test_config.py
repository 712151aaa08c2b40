"""ProxyConfig ``readinessProbe`` parsing: defaults, both field spellings, clear errors."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from istio_agent.config.env import ConfigError
from istio_agent.health.config import (
    ExecCheck,
    GRPCCheck,
    HTTPGetCheck,
    ReadinessProbeConfig,
    TCPCheck,
    parse_readiness_probe,
)


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
