from __future__ import annotations

import asyncio
import io
import json
import logging
import re

import pytest

from istio_agent import log
from istio_agent.log import report_failure


@pytest.fixture(autouse=True)
def _restore_logging():  # type: ignore[no-untyped-def]
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name in ("istio", "istio.sds", "grpc"):
        logging.getLogger(name).setLevel(logging.NOTSET)


def test_istio_console_format() -> None:
    out = io.StringIO()
    log.configure("default:info", stream=out)
    log.scope("sds").info("hello %s", "world")
    line = out.getvalue().strip()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z\tinfo\tsds\thello world", line), line


def test_scope_levels_and_json() -> None:
    out = io.StringIO()
    log.configure("default:warn,sds:debug", as_json=True, stream=out)
    log.scope("cache").info("hidden")
    log.scope("sds").debug("shown")
    entries = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [(e["scope"], e["level"], e["msg"]) for e in entries] == [("sds", "debug", "shown")]


def test_bad_level_is_an_error() -> None:
    with pytest.raises(ValueError, match="invalid log level"):
        log.parse_output_levels("sds:loud")


async def test_a_background_task_that_dies_is_reported_when_it_dies(caplog: pytest.LogCaptureFixture) -> None:
    async def buggy() -> None:
        raise ZeroDivisionError("a bug")

    task = asyncio.get_running_loop().create_task(buggy())
    task.add_done_callback(report_failure(logging.getLogger("istio_agent.test"), "the rotation"))
    await asyncio.gather(task, return_exceptions=True)  # retrieved, as a stop step would: still reported
    records = [record for record in caplog.records if record.getMessage() == "the rotation failed"]
    assert len(records) == 1 and "ZeroDivisionError: a bug" in caplog.text


async def test_a_cancelled_task_is_not_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    task = asyncio.get_running_loop().create_task(asyncio.sleep(10))
    task.add_done_callback(report_failure(logging.getLogger("istio_agent.test"), "the sleep"))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert "failed" not in caplog.text
