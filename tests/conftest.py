"""Shared fixtures."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from istio_agent.cli.runtime import prepare_process
from tests.ci_skips import fail_unmet_want
from tests.grpcio_process import prepare_grpcio_process

prepare_process()  # as every entry point does
prepare_grpcio_process()  # this process runs grpcio and forks: before anything loads grpc


@pytest.fixture(autouse=True)
def logging_as_it_was() -> Iterator[None]:
    """Each test leaves logging as it found it: code under test that configures logging in this
    process (an entry point's ``configure``, a scope's level) would otherwise change which records
    later tests' ``caplog`` sees, depending on the order the tests ran in."""
    manager = logging.Logger.manager
    disabled = manager.disable
    root = logging.getLogger()
    handlers = list(root.handlers)
    loggers = {
        name: logger for name, logger in manager.loggerDict.items() if isinstance(logger, logging.Logger)
    }
    saved = {name: (logger.level, logger.propagate, logger.disabled) for name, logger in loggers.items()}
    root_level = root.level
    yield
    logging.disable(disabled)
    root.setLevel(root_level)
    for handler in list(root.handlers):
        if handler not in handlers and not type(handler).__module__.startswith("_pytest"):
            root.removeHandler(handler)
    for name, logger in manager.loggerDict.items():
        if not isinstance(logger, logging.Logger):
            continue
        level, propagate, was_disabled = saved.get(name, (logging.NOTSET, True, False))
        logger.setLevel(level)
        logger.propagate = propagate
        logger.disabled = was_disabled


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary directory with a short path: Unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="ia-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], Any]]:
    """asyncio's own loop for every test, plus uvloop (the agent's loop) for tests marked ``both_loops``.

    The two loops' transports differ (uvloop's do not subclass asyncio's), so servers are tested on both.
    """
    factories: dict[str, Callable[[], Any]] = {"asyncio": asyncio.new_event_loop}
    if item.get_closest_marker("both_loops") is not None:
        import uvloop

        factories["uvloop"] = uvloop.new_event_loop
    return factories


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """Under CI=true a skip for want of root, a Debian tool or overlayfs fails (tests/ci_skips.py)."""
    outcome = yield
    fail_unmet_want(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    """The same for a whole module skipped while it is collected."""
    outcome = yield
    fail_unmet_want(outcome.get_result())
