"""Shared fixtures."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from istio_agent.cli.runtime import prepare_process

prepare_process()  # as every entry point does, before anything loads grpc


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
