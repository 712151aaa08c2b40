"""End to end: WasmPlugins from the local control plane run in real Envoy, their modules fetched by the agent.

Two workloads (``a`` calls ``b``), each with ``pilot-agent proxy`` and Envoy, fed by the local control
plane, whose mesh file holds a WasmPlugin with a remote module: over HTTP from a server in this test,
or as an OCI image from a real registry (Debian's docker-registry). The control plane sends the
remote code over ECDS as istiod does (an ``http_uri`` on the ``_`` cluster, which Envoy cannot
fetch); the agent fetches, checks and caches the module and gives Envoy a local file. The module is
the test filter of ``tests/wasm/filter`` (``x-wasm-plugin: <its configuration>`` on every response).
"""

from __future__ import annotations

import hashlib
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from istio_agent.ctl.local import free_port, wait_until
from istio_agent.ctl.localmesh import LocalMesh, Service, Workload, admin_json
from tests.e2e.harness import agentctl
from tests.wasm.registry import ARTIFACT, DOCKER, push_wasm, running_registry
from tests.wasm.wasm_filter import add_header_wasm

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

HEADER = "x-wasm-plugin"


class ModuleServer:
    """Serves one module at ``/add_header.wasm`` over plain HTTP and counts the requests for it."""

    def __init__(self, module: bytes) -> None:
        self.module = module
        self.requests = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != "/add_header.wasm":
                    self.send_error(404)
                    return
                server.requests += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(server.module)))
                self.end_headers()
                self.wfile.write(server.module)

            def log_message(self, *args: Any) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}/add_header.wasm"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()


@pytest.fixture
def module() -> bytes:
    return add_header_wasm().read_bytes()


@pytest.fixture
def module_server(module: bytes) -> Iterator[ModuleServer]:
    server = ModuleServer(module)
    yield server
    server.stop()


def plugin(url: str, config: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {"name": "headers", "namespace": "default", "url": url, "pluginConfig": config, **spec}


def start_mesh(base: Path, *, delta: bool, agent_env: dict[str, str] | None = None, **mesh: Any) -> LocalMesh:
    local = LocalMesh(
        base,
        [Service("b", 8000)],
        [Workload("a", base / "a", calls=["b"]), Workload("b", base / "b", backs=["b"])],
        delta=delta,
        agent_env=agent_env,
    )
    local.update_mesh(**mesh)
    local.start_controlplane()
    for workload in local.workloads:
        local.start_workload(workload)
    return local


def get(port: int, timeout: float = 3) -> tuple[int, dict[str, str]]:
    """Status and headers of a request from ``a`` to ``b`` through a's outbound listener."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/hello", timeout=timeout) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}


def wait_for_status(port: int, status: int, what: str) -> dict[str, str]:
    seen: list[tuple[int, dict[str, str]]] = []

    def answered() -> bool:
        try:
            seen.append(get(port))
        except OSError:
            return False
        return seen[-1][0] == status

    try:
        wait_until(answered, 60, what)
    except TimeoutError as err:
        raise TimeoutError(f"{err}; last answer {seen[-1:] or 'none'}") from None
    return seen[-1][1]


def ecds_filters(admin_port: int) -> list[dict[str, Any]]:
    dump = admin_json(admin_port, "/config_dump?resource=ecds_filters")
    return [entry["ecds_filter"] for entry in dump.get("configs", [])]


def stop_all(local: LocalMesh) -> None:
    codes = local.stop()
    for name, code in codes.items():
        assert code == 0, f"{name} exited with {code}:\n{local.processes.log_tail(name)}"


@pytest.mark.parametrize("delta", [False, True], ids=["sotw", "delta"])
def test_http_module_runs_in_envoy_and_a_restart_uses_the_cache(
    short_tmp: Path, module_server: ModuleServer, module: bytes, delta: bool
) -> None:
    sha = hashlib.sha256(module).hexdigest()
    local = start_mesh(
        short_tmp,
        delta=delta,
        wasmPlugins=[plugin(module_server.url, {"greeting": "over http"}, sha256=sha)],
    )
    a, b = local.workload("a"), local.workload("b")
    try:
        headers = wait_for_status(a.outbound_port("b"), 200, "a request from a to b to pass the plugin")
        # The plugin runs on a's outbound and b's inbound connection managers: both add the header.
        assert json.loads(headers[HEADER].split(", ")[0]) == {"greeting": "over http"}, headers
        # Envoy got a local file in the agent's cache on the istio-data volume, not the remote code.
        [ecds] = ecds_filters(b.ports["admin"])
        assert ecds["name"] == "extensions.istio.io/wasmplugin/default.headers"
        code = ecds["typed_config"]["config"]["vm_config"]["code"]
        local_file = Path(code["local"]["filename"])
        assert local_file.is_relative_to(b.workdir / "var" / "lib" / "istio" / "data"), code
        assert local_file.read_bytes() == module
        assert "ISTIO_META" not in json.dumps(ecds)
        assert module_server.requests == 2  # once per agent
        # istioctl's view of it, through Envoy's admin API.
        summary = agentctl("proxy-config", "ecds", f"127.0.0.1:{b.ports['admin']}").splitlines()
        assert summary[0].split() == ["ECDS", "NAME", "TYPE"]
        assert summary[1].split() == [
            "extensions.istio.io/wasmplugin/default.headers",
            "envoy.extensions.filters.http.wasm.v3.Wasm",
        ]

        # Both agents restarted with the server gone: the modules come from the cache on disk.
        module_server.stop()
        for workload in (a, b):
            assert local.processes.stop(f"pilot-agent {workload.name}") == 0
        for workload in (a, b):
            local.start_agent(workload)
        headers = wait_for_status(a.outbound_port("b"), 200, "the plugin after the agents restarted")
        assert HEADER in headers, headers
        assert module_server.requests == 2
    finally:
        stop_all(local)


@pytest.mark.parametrize("fmt", [ARTIFACT, DOCKER])
def test_oci_module_from_a_registry_with_a_pull_secret(short_tmp: Path, module: bytes, fmt: str) -> None:
    """The registry is on loopback and plain HTTP: tried after https without WASM_INSECURE_REGISTRIES,
    as Istio's go-containerregistry does for loopback and RFC 1918 hosts."""
    with running_registry(auth=("puller", "s3cret")) as registry:
        push_wasm(registry, "filters/headers", "v1", module, fmt)
        secret = short_tmp / "registry.json"
        secret.write_bytes(registry.pull_secret())
        local = start_mesh(
            short_tmp,
            delta=True,
            pullSecrets=[{"name": "registry-cred", "dockerConfig": str(secret)}],
            wasmPlugins=[
                plugin(
                    f"oci://{registry.reference('filters/headers', 'v1')}",
                    {"from": "oci"},
                    imagePullSecret="registry-cred",
                )
            ],
        )
        try:
            a = local.workload("a")
            headers = wait_for_status(a.outbound_port("b"), 200, "the OCI plugin")
            assert json.loads(headers[HEADER].split(", ")[0]) == {"from": "oci"}
            log = (local.workload("b").workdir / "agent.log").read_text()
            assert "s3cret" not in log and "cHVsbGVyOnMzY3JldA" not in log  # the secret, plain or base64
        finally:
            stop_all(local)


@pytest.mark.parametrize(
    ("problem", "strategy", "status"),
    [
        ("unreachable", "FAIL_CLOSE", 403),
        ("unreachable", "FAIL_OPEN", 200),
        ("wrong-sha256", "FAIL_CLOSE", 403),
        ("metadata-address", "FAIL_CLOSE", 403),  # refused by the SSRF guard before any connection
        ("registry-down", "FAIL_CLOSE", 403),
        ("registry-down", "FAIL_OPEN", 200),
        ("oversized", "FAIL_CLOSE", 403),
    ],
)
def test_a_module_that_cannot_be_had_falls_back_to_istios_rbac_filter(
    short_tmp: Path, module_server: ModuleServer, problem: str, strategy: str, status: int
) -> None:
    spec: dict[str, Any] = {"failStrategy": strategy}
    env = {"WASM_HTTP_REQUEST_MAX_RETRIES": "1"}
    if problem == "unreachable":
        url = f"http://127.0.0.1:{free_port()}/add_header.wasm"  # nothing listens there
    elif problem == "wrong-sha256":
        url, spec["sha256"] = module_server.url, hashlib.sha256(b"another module").hexdigest()
    elif problem == "registry-down":
        url = f"oci://127.0.0.1:{free_port()}/filters/headers:v1"  # no registry there
    elif problem == "oversized":
        url, env["ISTIO_WASM_MAX_BINARY_SIZE_BYTES"] = module_server.url, "64"
    else:
        url = "http://169.254.169.254/add_header.wasm"
    local = start_mesh(
        short_tmp,
        delta=True,
        agent_env=env,
        wasmPlugins=[plugin(url, {"never": "runs"}, **spec)],
    )
    try:
        a = local.workload("a")
        headers = wait_for_status(a.outbound_port("b"), status, f"{status} from the {strategy} stand-in")
        assert HEADER not in headers
        [ecds] = ecds_filters(a.ports["admin"])
        assert ecds["typed_config"]["@type"].endswith("envoy.extensions.filters.http.rbac.v3.RBAC")
        expected = "wasm-default-deny" if strategy == "FAIL_CLOSE" else "wasm-default-allow"
        assert ecds["typed_config"]["rules_stat_prefix"] == expected
        summary = agentctl("proxy-config", "ecds", f"127.0.0.1:{a.ports['admin']}")
        assert "envoy.extensions.filters.http.rbac.v3.RBAC" in summary, summary
        log = (a.workdir / "agent.log").read_text()
        reason = {
            "unreachable": "cannot connect",
            "wrong-sha256": "checksum",
            "metadata-address": "169.254",
            "registry-down": "127.0.0.1",
            "oversized": "64",
        }
        assert reason[problem] in log, log[-2000:]
    finally:
        stop_all(local)
