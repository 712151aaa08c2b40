"""ISTIO_PROMETHEUS_ANNOTATIONS parsing and validation."""

from __future__ import annotations

import json

import pytest

from istio_agent.config import ConfigError
from istio_agent.config.prometheus import (
    RESERVED_PORTS,
    PrometheusTargets,
    ScrapeTarget,
    parse_prometheus_annotations,
)

STATUS = 15020


def parse(value: object, status_port: int = STATUS) -> PrometheusTargets | None:
    return parse_prometheus_annotations(json.dumps(value), status_port)


def test_unset_is_none() -> None:
    assert parse_prometheus_annotations(None, STATUS) is None


def test_scrape_false_is_none() -> None:
    assert parse({"scrape": "false", "port": "8080"}) is None
    assert parse({"scrape": "false", "targets": [{"port": "9090"}]}) is None


@pytest.mark.parametrize("scrape", ["true", "", "yes"])
def test_other_scrape_values_scrape(scrape: str) -> None:
    result = parse({"scrape": scrape, "port": "8080"})
    assert result is not None
    assert result.scrape == scrape


def test_legacy_defaults() -> None:
    result = parse({})
    assert result == PrometheusTargets(
        targets=(ScrapeTarget(80, "/metrics"),), scrape="", port="80", path="/metrics"
    )


def test_legacy_port_and_path() -> None:
    result = parse({"scrape": "true", "port": "8080", "path": "/stats"})
    assert result is not None
    assert result.targets == (ScrapeTarget(8080, "/stats"),)
    assert result.targets[0].name == "app:8080/stats"


def test_legacy_status_port_rejected() -> None:
    with pytest.raises(ConfigError, match=r"ISTIO_PROMETHEUS_ANNOTATIONS: port: .*status port"):
        parse({"port": "15020"})


def test_status_port_is_the_configured_one() -> None:
    with pytest.raises(ConfigError, match="status port"):
        parse({"port": "16000"}, status_port=16000)
    result = parse({"port": "16000"})
    assert result is not None and result.targets[0].port == 16000


def test_new_format_targets_preserved_in_order() -> None:
    result = parse({"targets": [{"port": "9090", "path": "/a"}, {"port": "8080", "path": "/b"}]})
    assert result is not None
    assert result.targets == (ScrapeTarget(9090, "/a"), ScrapeTarget(8080, "/b"))


def test_new_format_copies_top_level_from_first_target() -> None:
    result = parse({"targets": [{"port": "9090", "path": "/a"}, {"port": "8080", "path": "/b"}]})
    assert result is not None
    assert (result.port, result.path) == ("9090", "/a")


def test_new_format_keeps_existing_top_level_port() -> None:
    result = parse({"port": "7070", "targets": [{"port": "9090", "path": "/a"}]})
    assert result is not None
    assert (result.port, result.path) == ("7070", "/a")
    assert result.targets == (ScrapeTarget(9090, "/a"),)


def test_empty_target_path_defaults() -> None:
    result = parse({"targets": [{"port": "9090", "path": ""}, {"port": "9091"}]})
    assert result is not None
    assert [t.path for t in result.targets] == ["/metrics", "/metrics"]


def test_path_without_slash_gets_one() -> None:
    result = parse({"port": "9090", "path": "metrics"})
    assert result is not None and result.targets[0].path == "/metrics"


@pytest.mark.parametrize("port", sorted(RESERVED_PORTS))
def test_reserved_ports_rejected(port: int) -> None:
    with pytest.raises(ConfigError, match=r"targets\[1\]\.port: .*reserved"):
        parse({"targets": [{"port": "9090"}, {"port": str(port)}]}, status_port=1)


def test_reserved_list_is_istios() -> None:
    assert set(RESERVED_PORTS) == {15000, 15001, 15004, 15006, 15008, 15020, 15021, 15053, 15090}


def test_reserved_checked_numerically() -> None:
    with pytest.raises(ConfigError, match="reserved"):
        parse({"targets": [{"port": "015021"}]})


def test_leading_zero_status_port_rejected() -> None:
    with pytest.raises(ConfigError, match=r"targets\[0\]\.port: port '015020' is the agent's status port"):
        parse({"targets": [{"port": "015020"}]})
    with pytest.raises(ConfigError, match="status port"):
        parse({"port": "015020"})


def test_leading_zero_ordinary_port_accepted() -> None:
    result = parse({"port": "08080"})
    assert result is not None and result.targets[0].port == 8080


@pytest.mark.parametrize("port", ["abc", "80a", "-1", "1.5", " ", "0x50"])
def test_non_numeric_ports_rejected(port: str) -> None:
    with pytest.raises(
        ConfigError, match=r"ISTIO_PROMETHEUS_ANNOTATIONS: targets\[0\]\.port: .*not an integer"
    ):
        parse({"targets": [{"port": port}]})


def test_empty_target_port_rejected() -> None:
    with pytest.raises(ConfigError, match="not an integer"):
        parse({"targets": [{"path": "/m"}]})


@pytest.mark.parametrize("port", ["0", "65536", "99999"])
def test_out_of_range_ports_rejected(port: str) -> None:
    with pytest.raises(ConfigError, match="must be between 1 and 65535"):
        parse({"port": port})


def test_set_but_empty_is_an_error() -> None:
    with pytest.raises(ConfigError, match="ISTIO_PROMETHEUS_ANNOTATIONS: invalid JSON"):
        parse_prometheus_annotations("", STATUS)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{", "invalid JSON"),
        ("[]", "ANNOTATIONS: expected a map, got a list"),
        ('"x"', "ANNOTATIONS: expected a map, got a string"),
        ('{"port": 8080}', r"port: expected a string"),
        ('{"targets": {}}', r"targets: expected a list"),
        ('{"targets": ["9090"]}', r"targets\[0\]: expected a map"),
        ('{"targets": [{"port": 9090}]}', r"targets\[0\]\.port: expected a string"),
    ],
)
def test_malformed_json_names_the_variable_and_field(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match="ISTIO_PROMETHEUS_ANNOTATIONS") as info:
        parse_prometheus_annotations(text, STATUS)
    assert info.match(match)


def test_null_fields_are_empty() -> None:
    result = parse({"port": None, "path": None, "targets": None})
    assert result is not None and result.targets == (ScrapeTarget(80, "/metrics"),)
