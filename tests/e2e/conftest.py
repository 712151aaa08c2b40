"""Fixtures shared by the pod-shaped end-to-end tests (tests/e2e/pod.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.injector import ISTIOD_HOSTS
from tests.e2e.pod import Pod, running_pod


@pytest.fixture
def pod(short_tmp: Path) -> Iterator[Pod]:
    """A started pod whose /etc/hosts names the local control plane as istiod.istio-system.svc."""
    with running_pod(short_tmp, hosts=ISTIOD_HOSTS) as started:
        yield started
