"""The test Wasm filter in real Envoy (V8): each response carries ``x-wasm-plugin: <configuration>``."""

from __future__ import annotations

import os
import shutil
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from istio_agent.ctl.local import free_port
from tests.wasm import wasm_filter
from tests.wasm.wasm_filter import HEADER, add_header_module, running_envoy, wasm_http_filter

__all__ = ["add_header_module"]  # the fixture, used by name

ROUTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
}


def bootstrap(module: Path, configuration: str, port: int) -> dict[str, Any]:
    """One HTTP listener: the Wasm filter, then the router to a direct response."""
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
        ".HttpConnectionManager",
        "stat_prefix": "wasm_test",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "direct",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "direct_response": {"status": 200, "body": {"inline_string": "ok"}},
                        }
                    ],
                }
            ]
        },
        "http_filters": [wasm_http_filter(module, configuration), ROUTER],
    }
    return {
        "node": {"id": "wasm-filter-test", "cluster": "wasm-filter-test"},
        "static_resources": {
            "listeners": [
                {
                    "name": "http",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                    "filter_chains": [
                        {
                            "filters": [
                                {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                            ]
                        }
                    ],
                }
            ]
        },
    }


def get(port: int) -> tuple[int, dict[str, str], bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/anything", timeout=5) as response:
        return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()


@pytest.mark.e2e
@pytest.mark.parametrize("configuration", ["hello from wasm", '{"greeting":"other","n":2}'])
def test_the_filter_adds_its_configuration_as_a_header(
    add_header_module: Path, short_tmp: Path, configuration: str
) -> None:
    port = free_port()
    with running_envoy(short_tmp, bootstrap(add_header_module, configuration, port)):
        status, headers, body = get(port)
    assert (status, body) == (200, b"ok")
    assert headers.get(HEADER) == configuration


@pytest.mark.e2e
def test_without_the_filter_there_is_no_header(add_header_module: Path, short_tmp: Path) -> None:
    """The header comes from the filter, not from the route (the test above can fail)."""
    port = free_port()
    config = bootstrap(add_header_module, "x", port)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [ROUTER]
    with running_envoy(short_tmp, config):
        _, headers, _ = get(port)
    assert HEADER not in headers


def test_the_module_is_built_when_stale_and_kept_when_current(tmp_path: Path) -> None:
    if shutil.which("wat2wasm") is None:
        pytest.skip("wat2wasm is not installed (Debian's wabt)")
    module = tmp_path / "out" / "add_header.wasm"
    assert wasm_filter.stale(wasm_filter.SOURCE, module)
    wasm_filter.build(wasm_filter.SOURCE, module)
    assert module.read_bytes()[:4] == b"\0asm"
    assert not wasm_filter.stale(wasm_filter.SOURCE, module)
    os.utime(module, (0, 0))
    assert wasm_filter.stale(wasm_filter.SOURCE, module)


def test_without_wat2wasm_the_build_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(wasm_filter.Wat2WasmMissing, match="wat2wasm is not installed"):
        wasm_filter.build(wasm_filter.SOURCE, tmp_path / "add_header.wasm")
