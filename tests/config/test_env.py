from __future__ import annotations

from datetime import timedelta

import pytest

from istio_agent.config.env import ConfigError, Env, parse_go_bool, parse_go_duration


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24h", timedelta(hours=24)),
        ("1h30m", timedelta(hours=1, minutes=30)),
        ("100ms", timedelta(milliseconds=100)),
        ("1.5s", timedelta(seconds=1.5)),
        ("0", timedelta(0)),
        ("-2s", timedelta(seconds=-2)),
        ("300us", timedelta(microseconds=300)),
    ],
)
def test_go_durations(text: str, expected: timedelta) -> None:
    assert parse_go_duration(text) == expected


@pytest.mark.parametrize("text", ["", "24", "h", "1d", "1h 30m", "abc"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_go_duration(text)


def test_go_bools() -> None:
    assert parse_go_bool("true") and parse_go_bool("1") and parse_go_bool("T")
    assert not parse_go_bool("false") and not parse_go_bool("0")
    with pytest.raises(ValueError):
        parse_go_bool("yes")


def test_invalid_value_names_the_variable() -> None:
    env = Env({"SECRET_TTL": "tomorrow", "PKCS8_KEY": "maybe"})
    with pytest.raises(ConfigError, match="SECRET_TTL='tomorrow'"):
        env.duration("SECRET_TTL", timedelta(hours=24))
    with pytest.raises(ConfigError, match="PKCS8_KEY"):
        env.flag("PKCS8_KEY")


def test_empty_value_means_default() -> None:
    assert Env({"X": ""}).integer("X", 7) == 7


def test_prefix() -> None:
    env = Env({"CA_HEADER_FOO": "foo", "CA_HEADER_BAZ": "=baz", "XDS_HEADER_X": "x"})
    assert env.with_prefix("CA_HEADER_") == {"FOO": "foo", "BAZ": "=baz"}
