"""The test Wasm filter (tests/wasm/filter/add_header.wat), built with wabt's ``wat2wasm``, and a real Envoy.

The filter adds ``x-wasm-plugin: <plugin configuration>`` to every response (the configuration is the
StringValue Envoy's ``envoy.filters.http.wasm`` hands the plugin). ``make wasm-filter`` runs this module
into ``build/wasm/add_header.wasm``; :func:`add_header_wasm` builds it when it is missing or older than
its source, so ``pytest tests/<one file>`` works alone, and skips when ``wat2wasm`` is not installed.

    from tests.wasm.wasm_filter import add_header_wasm, running_envoy
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "tests" / "wasm" / "filter" / "add_header.wat"
MODULE = REPO / "build" / "wasm" / "add_header.wasm"
HEADER = "x-wasm-plugin"
"""The response header the filter adds."""
WASM_FILTER = "envoy.filters.http.wasm"
WASM_FILTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
V8 = "envoy.wasm.runtime.v8"


class Wat2WasmMissing(RuntimeError):
    """wabt's ``wat2wasm`` is not on PATH."""


def stale(source: Path = SOURCE, module: Path = MODULE) -> bool:
    """Whether the module is missing or older than its source."""
    return not module.exists() or module.stat().st_mtime < source.stat().st_mtime


def build(source: Path = SOURCE, module: Path = MODULE) -> Path:
    """``wat2wasm`` into a scratch file beside ``module``, then renamed: concurrent test workers
    never load half a module."""
    wat2wasm = shutil.which("wat2wasm")
    if wat2wasm is None:
        raise Wat2WasmMissing("wat2wasm is not installed (Debian's wabt: apt-get install wabt)")
    module.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=module.parent) as scratch:
        out = Path(scratch) / module.name
        done = subprocess.run(
            [wat2wasm, str(source), "-o", str(out)], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"wat2wasm {source} failed: {done.stderr.strip()}")
        os.replace(out, module)
    return module


def add_header_wasm() -> Path:
    """The built filter's path, built first when stale; skips the test without ``wat2wasm``."""
    if stale():
        try:
            build()
        except Wat2WasmMissing as err:
            pytest.skip(str(err))
    return MODULE


@pytest.fixture
def add_header_module() -> Path:
    """The built filter (import this fixture into a test module to use it)."""
    return add_header_wasm()


def wasm_http_filter(module: Path, configuration: str, name: str = "add_header") -> dict[str, Any]:
    """``envoy.filters.http.wasm`` running ``module`` from a local file with a StringValue configuration."""
    return {
        "name": WASM_FILTER,
        "typed_config": {
            "@type": WASM_FILTER_TYPE,
            "config": {
                "name": name,
                "vm_config": {"runtime": V8, "code": {"local": {"filename": str(module)}}},
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": configuration,
                },
            },
        },
    }


def running_envoy(directory: Path, bootstrap: dict[str, Any]) -> AbstractContextManager[str]:
    """A real Envoy on ``bootstrap`` plus an admin listener; yields the admin address once it is ready.

    The tests' one Envoy runner, ``admin_envoy`` of tests/ctl/test_envoylog.py (its log is
    ``directory/envoy-<admin port>.log``, quoted when Envoy exits early).
    """
    from tests.ctl.test_envoylog import admin_envoy  # not for ``make wasm-filter``, which only builds

    return admin_envoy(directory, **bootstrap)


def main() -> int:
    """``make wasm-filter``: build (make decides when)."""
    try:
        print(f"built {build().relative_to(REPO)}")
    except Wat2WasmMissing as err:
        print(f"note: {err}; the Wasm filter tests will skip", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
