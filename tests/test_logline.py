"""Istio's log line without ``logging`` (``istio_agent.logline``): the one encoding the agent's
formatters and the CNI plugin share, and scopes that go to ``logging`` unless a process writes its
own lines."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from istio_agent import log, logline


@pytest.fixture(autouse=True)
def _default_sink() -> Iterator[None]:
    yield
    logline.hand_to_logging()


@pytest.mark.parametrize("created", [0.0, 1.5, 1764840000.123456, 1764840000.9999996, 1764840059.000001])
def test_the_timestamp_is_what_datetime_writes(created: float) -> None:
    expected = datetime.fromtimestamp(created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    assert logline.timestamp(created) == expected


def test_lines_are_written_at_or_above_the_level_with_their_arguments() -> None:
    out = io.StringIO()
    logline.write_lines("warn", as_json=True, stream=out)
    scope = logline.Scope("cni-plugin")
    scope.info("hidden %s", "x")
    scope.warning("pod %s/%s: %d%%", "ns", "p", 5)
    scope.error("plain 100%")  # no arguments: the message is not %-formatted
    entries = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(e["level"], e["scope"], e["msg"]) for e in entries] == [
        ("warn", "cni-plugin", "pod ns/p: 5%"),
        ("error", "cni-plugin", "plain 100%"),
    ]
    assert set(entries[0]) == {"time", "level", "scope", "msg"}


def test_an_unknown_level_is_refused_and_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="invalid log level 'loud'"):
        logline.write_lines("loud", as_json=True)
    caplog.set_level(logging.INFO, logger="istio.cni")
    logline.Scope("cni").info("still to logging")
    assert [r.getMessage() for r in caplog.records] == ["still to logging"]


def test_by_default_a_scope_hands_its_entries_to_logging(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="istio.cni")
    logline.Scope("cni").debug("skipping %s", "v6")
    [record] = caplog.records
    assert (record.name, record.levelno, record.getMessage()) == ("istio.cni", logging.DEBUG, "skipping v6")


def test_the_agents_formatters_and_the_line_writer_write_the_same_line() -> None:
    record = logging.LogRecord("istio.sds", logging.WARNING, __file__, 1, "hello %s", ("world",), None)
    json_out, console_out = io.StringIO(), io.StringIO()
    logline.LineWriter(logline.DEBUG, as_json=True, stream=json_out)(
        "sds", logging.WARNING, "hello %s", ("world",)
    )
    logline.LineWriter(logline.DEBUG, as_json=False, stream=console_out)(
        "sds", logging.WARNING, "hello %s", ("world",)
    )
    # the same encoding; each has its own clock, so all but the time is compared
    ours, theirs = json.loads(json_out.getvalue()), json.loads(log.JsonFormatter().format(record))
    assert ours.keys() == theirs.keys() and {**ours, "time": ""} == {**theirs, "time": ""}
    ours_fields = console_out.getvalue().rstrip("\n").split("\t")
    assert (
        ours_fields[1:]
        == log.IstioFormatter().format(record).split("\t")[1:]
        == ["warn", "sds", "hello world"]
    )
