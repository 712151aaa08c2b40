from __future__ import annotations

from datetime import timedelta

import pytest

from istio_agent.config.env import (
    MAX_DURATION,
    ConfigError,
    Env,
    out_of_range,
    parse_go_bool,
    parse_go_duration,
    parse_go_int,
)


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


@pytest.mark.parametrize("text", ["", "24", "h", "1d", "1h 30m", "abc", ".s", "\u0663s", "1.5"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_go_duration(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("99999999999h", 'time: invalid duration "99999999999h"'),
        ("2562047h47m16.854775808s", 'time: invalid duration "2562047h47m16.854775808s"'),
        ("9" * 30 + "ns", "time: invalid duration"),
        ("1d", 'time: unknown unit "d" in duration "1d"'),
        ("24", 'time: missing unit in duration "24"'),
    ],
)
def test_durations_beyond_go_are_refused_with_go_messages(text: str, message: str) -> None:
    """Go's range is ±2**63 ns; beyond it the parse was an OverflowError (a traceback at start-up)."""
    with pytest.raises(ValueError) as caught:
        parse_go_duration(text)
    assert not isinstance(caught.value, OverflowError)
    assert message in str(caught.value)


def test_go_duration_range_edges() -> None:
    assert parse_go_duration("2562047h47m16.854775807s") == MAX_DURATION
    assert parse_go_duration("-2562047h47m16.854775808s") == -MAX_DURATION
    assert parse_go_duration("5.s") == timedelta(seconds=5)
    assert parse_go_duration("0.5h") == timedelta(minutes=30)


def test_go_ints() -> None:
    assert parse_go_int(" 42 ") == 42 and parse_go_int("-7") == -7
    for text in ("1_000", "\u0663", "1.0", "", "9" * 20):
        with pytest.raises(ValueError):
            parse_go_int(text)


def test_out_of_range_messages() -> None:
    assert out_of_range(5, 1, 10) is None
    assert out_of_range(0, 1, 10) == "must be between 1 and 10"
    assert out_of_range(0, 1, None) == "must be at least 1"
    assert out_of_range(11, None, 10) == "must be at most 10"


def test_bounds_name_the_variable_and_value() -> None:
    env = Env({"N": "99999999", "R": "inf", "D": "25h", "E": ""})
    with pytest.raises(ConfigError, match=r"invalid value for N='99999999': must be between 2048 and 8192$"):
        env.integer("N", 2048, minimum=2048, maximum=8192)
    with pytest.raises(ConfigError, match="R='inf': 'inf' is not a finite number"):
        env.number("R", 0.5, minimum=0, maximum=1)
    with pytest.raises(ConfigError, match="D='25h': must be between 1ms and 24h0m0s"):
        env.duration("D", timedelta(1), minimum=timedelta(milliseconds=1), maximum=timedelta(hours=24))
    assert env.duration("E", timedelta(days=400), maximum=timedelta(hours=1)) == timedelta(
        days=400
    )  # a default


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
