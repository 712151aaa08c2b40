from __future__ import annotations

import io
import json
import logging
import re

import pytest

from istio_agent import log


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
