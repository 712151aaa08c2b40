"""End to end: a WasmPlugin's remote module in the injected sidecar, as a pod runs it.

The ``istio-proxy`` container of tests/e2e/test_pod_sidecar.py (the proxy image, uid 1337, no
capabilities, a read-only root, only the injector's volumes writable, cwd ``/``) gets a WasmPlugin from
the local control plane, whose ECDS resource carries the module's URL as istiod sends it. The agent must
fetch it into the ``istio-data`` volume (``/var/lib/istio/data``, Istio's cache directory in a pod) and
give Envoy that file; a restarted container must find it there with the server gone; a module that
cannot be fetched must become Istio's deny-all RBAC filter, without the agent writing anywhere else; a
module published as a tar.gz must be unwrapped without a scratch file (the root and /tmp are read-only).

The module is the test filter of tests/wasm/filter (``x-wasm-plugin: <its configuration>`` on every
response), served by tests/e2e/wasm_server.py in the pod's network. The pod's workload calls its own
service through an outbound binding, so a request crosses Envoy's outbound and its mTLS inbound
listener, both running the plugin, to an app on the workload's ``appPort``.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from istio_agent.ctl.local import wait_until
from tests.e2e.injector import PROXY_UID, Istiod, mesh_for
from tests.e2e.pod import Pod, stop_process, unsupported
from tests.e2e.test_pod_sidecar import assert_clean_log, sidecar, written_files
from tests.e2e.wasm_server import requests_seen, start_module_server
from tests.images.built import unavailable
from tests.wasm.wasm_filter import HEADER, add_header_wasm

CANNOT_RUN = unsupported() or unavailable("proxyv2")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(120),
    pytest.mark.skipif(CANNOT_RUN is not None, reason=CANNOT_RUN or ""),
]

MODULE_PORT = 8090
"""The module server, on the pod's loopback (the agent's fetch goes through the SSRF guard, which
allows loopback as Istio's does)."""
APP_PORT = 8080  # mesh_for's appPort
OUTBOUND_PORT = 15201
"""The workload's outbound binding to its own service: Envoy's outbound listener, then its inbound."""
PLUGIN_NAME = "extensions.istio.io/wasmplugin/default.headers"
CACHE_DIR = Path("/var/lib/istio/data")
WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
RBAC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC"
CONFIG = {"greeting": "from the pod"}


@pytest.fixture
def module() -> bytes:
    return add_header_wasm().read_bytes()


@pytest.fixture
def app(pod: Pod) -> subprocess.Popen[bytes]:
    """The workload's app on its ``appPort``: any 200 will do (``GET /`` lists an empty directory)."""
    root = pod.base / "app"
    root.mkdir()
    args = [
        sys.executable,
        "-m",
        "http.server",
        str(APP_PORT),
        "--bind",
        "127.0.0.1",
        "--directory",
        str(root),
    ]
    process = pod.run_in_network(args, pod.base / "app.log")
    wait_until(lambda: pod.port_open(APP_PORT), 10, "the app to listen")
    return process


def module_url(name: str = "add_header.wasm") -> str:
    return f"http://127.0.0.1:{MODULE_PORT}/{name}"


def tar_gz(name: str, content: bytes) -> bytes:
    """``content`` as the one file of a gzipped tar (how some build pipelines publish a module)."""
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w:gz") as archive:
        entry = tarfile.TarInfo(name)
        entry.size = len(content)
        archive.addfile(entry, io.BytesIO(content))
    return packed.getvalue()


def start_istiod(pod: Pod, plugin: dict[str, Any]) -> Istiod:
    """The control plane with the plugin, the pod's workload calling its own service on OUTBOUND_PORT."""
    mesh = mesh_for(pod, wasmPlugins=[{"name": "headers", "namespace": pod.namespace, **plugin}])
    [workload] = mesh["workloads"]
    workload["outbound"] = [{"service": pod.name, "port": OUTBOUND_PORT}]
    istiod = Istiod(pod, mesh)
    istiod.start()
    return istiod


def ecds_filter(pod: Pod) -> dict[str, Any] | None:
    """The plugin's filter as Envoy runs it (its admin API's ECDS config dump), None before it has it."""
    status, body = pod.http("GET", 15000, "/config_dump?resource=ecds_filters")
    if status != 200:
        return None
    configs = [entry["ecds_filter"] for entry in json.loads(body).get("configs", [])]
    return next((config for config in configs if config.get("name") == PLUGIN_NAME), None)


def wait_for_ecds(pod: Pod, type_url: str) -> dict[str, Any]:
    """The plugin's filter once Envoy has one of ``type_url``."""
    seen: list[dict[str, Any] | None] = []

    def arrived() -> bool:
        seen.append(ecds_filter(pod))
        return seen[-1] is not None and seen[-1]["typed_config"]["@type"] == type_url

    try:
        wait_until(arrived, 30, f"Envoy to get {PLUGIN_NAME} as {type_url.rsplit('.', 1)[-1]}")
    except TimeoutError as err:
        raise TimeoutError(f"{err}; last: {seen[-1:]}\n{pod.describe('istio-proxy')}") from None
    filter_config = seen[-1]
    assert filter_config is not None
    return filter_config["typed_config"]


def request(pod: Pod) -> tuple[int, dict[str, list[str]]]:
    """A request from the pod to its own service through its outbound binding: (status, each header's
    values, in order)."""
    connection = http.client.HTTPConnection("127.0.0.1", OUTBOUND_PORT, timeout=5)
    connection.sock = pod.socket()
    connection.sock.settimeout(5)
    try:
        connection.sock.connect(("127.0.0.1", OUTBOUND_PORT))
        connection.request("GET", "/")
        response = connection.getresponse()
        response.read()
        headers: dict[str, list[str]] = {}
        for key, value in response.getheaders():
            headers.setdefault(key.lower(), []).append(value)
        return response.status, headers
    finally:
        connection.close()


def agent_metric(pod: Pod, name: str, **labels: str) -> float | None:
    """A sample of the agent's own metrics as Prometheus scrapes the pod (15020's merged
    ``/stats/prometheus``, Istio's ``istio_agent_`` names); None when the series is absent."""
    status, body = pod.http("GET", 15020, "/stats/prometheus")
    assert status == 200, body
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == f"istio_agent_{name}" and sample.labels == labels:
                return sample.value
    return None


def local_module(pod: Pod, typed_config: dict[str, Any]) -> Path:
    """The module file Envoy was given, found in the pod's ``istio-data`` volume."""
    code = typed_config["config"]["vm_config"]["code"]
    assert set(code) == {"local"}, code  # not the remote code istiod sent
    filename = Path(code["local"]["filename"])
    assert filename.is_relative_to(CACHE_DIR), f"{filename} is not in the istio-data volume"
    return pod.volume("istio-data") / filename.relative_to(CACHE_DIR)


def test_the_module_is_fetched_into_istio_data_and_a_restarted_container_uses_it_without_the_server(
    pod: Pod, module: bytes, app: subprocess.Popen[bytes]
) -> None:
    served = pod.base / "modules"
    served.mkdir()
    (served / "add_header.wasm").write_bytes(module)
    requests = pod.base / "module-requests.log"
    server = start_module_server(pod, MODULE_PORT, served, requests)
    sha = hashlib.sha256(module).hexdigest()
    istiod = start_istiod(pod, {"url": module_url(), "sha256": sha, "pluginConfig": CONFIG})

    first = pod.start_container(sidecar(pod, istiod, grace_period=10))
    pod.wait_ready("istio-proxy")
    cached = local_module(pod, wait_for_ecds(pod, WASM_TYPE))
    assert cached.read_bytes() == module
    assert cached.stat().st_uid == PROXY_UID and cached.stat().st_mode & 0o777 == 0o644
    # Istio's layout (pkg/wasm/cache.go getModulePath): <sha256 of the URL>/<sha256 of the module>.wasm
    module_dir = hashlib.sha256(module_url().encode()).hexdigest()
    assert cached.relative_to(pod.volume("istio-data")) == Path(module_dir, f"{sha}.wasm")
    assert written_files(pod.volume("istio-data")) == [module_dir, f"{module_dir}/{sha}.wasm", "urls.json"]
    status, headers = request(pod)
    assert status == 200, headers
    # the outbound and the inbound connection manager each ran the plugin
    assert [json.loads(value) for value in headers[HEADER]] == [CONFIG, CONFIG], headers
    assert requests_seen(requests) == ["GET /add_header.wasm"]
    assert agent_metric(pod, "wasm_remote_fetch_count", result="success") == 1
    assert agent_metric(pod, "wasm_config_conversion_count", result="success") == 1

    # The container restarted with the server gone: the module comes from the istio-data volume.
    stop_process(server)
    assert pod.stop_container("istio-proxy") == 0
    restarted = pod.restart_container("istio-proxy")
    pod.wait_ready("istio-proxy")
    assert local_module(pod, wait_for_ecds(pod, WASM_TYPE)) == cached
    status, headers = request(pod)
    assert status == 200 and HEADER in headers, (status, headers)
    assert requests_seen(requests) == ["GET /add_header.wasm"]
    restarted_log = restarted.log.read_text()
    assert "Wasm module cache: 1 modules from an earlier run in /var/lib/istio/data" in restarted_log
    assert "fetched Wasm module" not in restarted_log
    assert agent_metric(pod, "wasm_cache_lookup_count", hit="true") == 1
    assert agent_metric(pod, "wasm_remote_fetch_count", result="success") is None
    assert written_files(pod.volume("istio-data")) == [module_dir, f"{module_dir}/{sha}.wasm", "urls.json"]
    assert pod.stop_container("istio-proxy") == 0
    for container in (first, restarted):
        assert_clean_log(container)


def test_a_module_that_cannot_be_fetched_fails_closed_with_istios_deny_filter(
    pod: Pod, module: bytes, app: subprocess.Popen[bytes]
) -> None:
    sha = hashlib.sha256(module).hexdigest()
    istiod = start_istiod(pod, {"url": module_url(), "sha256": sha, "pluginConfig": CONFIG})  # no server

    running = pod.start_container(sidecar(pod, istiod, grace_period=10))
    pod.wait_ready("istio-proxy")
    deny = wait_for_ecds(pod, RBAC_TYPE)
    assert deny["rules_stat_prefix"] == "wasm-default-deny" and deny.get("rules", {}) == {}, deny
    status, headers = request(pod)
    assert status == 403 and HEADER not in headers, (status, headers)
    log = running.log.read_text()
    assert f"cannot use Wasm module of {PLUGIN_NAME}" in log and "cannot connect" in log, pod.describe(
        "istio-proxy"
    )
    assert "applying the deny RBAC filter" in log
    assert agent_metric(pod, "wasm_remote_fetch_count", result="download_failure") == 1
    assert agent_metric(pod, "wasm_config_conversion_count", result="fetch_failure") == 1
    assert not list(pod.volume("istio-data").rglob("*.wasm"))
    assert pod.stop_container("istio-proxy") == 0
    assert_clean_log(running)


def test_a_tar_gz_module_is_unwrapped_without_writing_outside_the_volumes(
    pod: Pod, module: bytes, app: subprocess.Popen[bytes]
) -> None:
    served = pod.base / "modules"
    served.mkdir()
    (served / "add_header.tar.gz").write_bytes(tar_gz("plugin.wasm", module))
    start_module_server(pod, MODULE_PORT, served, pod.base / "module-requests.log")
    sha = hashlib.sha256(module).hexdigest()  # the module's, as Istio checks it once unwrapped
    istiod = start_istiod(
        pod, {"url": module_url("add_header.tar.gz"), "sha256": sha, "pluginConfig": CONFIG}
    )

    running = pod.start_container(sidecar(pod, istiod, grace_period=10))
    pod.wait_ready("istio-proxy")
    assert local_module(pod, wait_for_ecds(pod, WASM_TYPE)).read_bytes() == module
    status, headers = request(pod)
    assert status == 200 and HEADER in headers, (status, headers)
    assert pod.stop_container("istio-proxy") == 0
    assert_clean_log(running)
