"""``agentctl demo``: a two-workload mesh on loopback, with no root and nothing installed by hand.

What runs: the local control plane (CA + ADS from a mesh file), and for each of the workloads
``a`` and ``b`` a tiny HTTP app, ``pilot-agent proxy`` and the real Envoy the agent starts. Envoy
gets its certificates over SDS and its configuration over ADS, both from its agent. The demo
then plays ``a``'s application: it calls service ``b`` through ``a``'s Envoy, and the request
crosses the mesh over mTLS; ``b``'s Envoy tells the app who called (x-forwarded-client-cert).

With ``--wasm MODULE`` the mesh file also holds a WasmPlugin whose module the demo serves over HTTP:
the agents fetch it, check its sha256 and hand Envoy the cached file (docs/wasm.md); the plugin's
response headers show in the output.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from istio_agent.ctl.local import wait_until
from istio_agent.ctl.localmesh import LocalMesh, Service, Workload, admin_json, dynamic_names
from istio_agent.dns.client import lookup

Echo = Callable[[str], None]


def build_mesh(base: Path) -> LocalMesh:
    """Service ``b`` on port 8000, backed by workload ``b``; workload ``a`` may call it."""
    services = [Service("b", 8000)]
    workloads = [Workload("a", base / "a", calls=["b"]), Workload("b", base / "b", backs=["b"])]
    return LocalMesh(base, services, workloads)


def certificate(admin_port: int) -> tuple[str, str]:
    """The SPIFFE identity and expiry of the workload certificate Envoy serves (from its admin API)."""
    try:
        certs = admin_json(admin_port, "/certs")["certificates"]
    except (OSError, KeyError, ValueError):
        return "", ""
    for entry in certs:
        for cert in entry.get("cert_chain", []):
            uris = [san["uri"] for san in cert.get("subject_alt_names", []) if "uri" in san]
            if uris:
                return uris[0], cert.get("expiration_time", "")
    return "", ""


def call(port: int, path: str = "/hello") -> tuple[int, dict[str, Any]]:
    status, _, answer = call_with_headers(port, path)
    return status, answer


def call_with_headers(port: int, path: str = "/hello") -> tuple[int, dict[str, str], dict[str, Any]]:
    """Status, response headers (lower-case names) and the app's JSON answer."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        headers = {name.lower(): value for name, value in response.headers.items()}
        return response.status, headers, json.load(response)


@contextmanager
def serving_module(module: bytes) -> Iterator[str]:
    """Serve ``module`` at a loopback URL while the block runs (the plugin's remote code)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(module)))
            self.end_headers()
            self.wfile.write(module)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="demo-wasm-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/plugin.wasm"
    finally:
        server.shutdown()
        server.server_close()


def wasm_plugin(url: str, module: bytes) -> dict[str, Any]:
    """The demo's WasmPlugin (the mesh file's ``wasmPlugins`` entry, WasmPlugin spec names)."""
    return {
        "name": "demo-headers",
        "namespace": "default",
        "url": url,
        "sha256": hashlib.sha256(module).hexdigest(),
        "pluginConfig": {"demo": "hello from Wasm"},
    }


def _answers(port: int) -> bool:
    try:
        return call(port)[0] == 200
    except OSError:
        return False


def _expiry(text: str) -> str:
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return text or "?"
    hours = (when - datetime.now(UTC)).total_seconds() / 3600
    return f"{when:%Y-%m-%d %H:%M} UTC (in {hours:.1f} h)"


def _table(rows: Sequence[tuple[str, ...]], echo: Echo) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        echo("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def run_demo(base: Path, keep: bool, echo: Echo, wasm: Path | None = None) -> int:
    """Run the demo under ``base`` (with a WasmPlugin of the ``wasm`` module); return the exit status."""
    if wasm is None:
        return _run(base, keep, echo, None)
    module = wasm.read_bytes()
    if not module.startswith(b"\0asm"):
        raise RuntimeError(f"{wasm} is not a Wasm module (it does not start with \\0asm)")
    with serving_module(module) as url:
        return _run(base, keep, echo, wasm_plugin(url, module))


def _run(base: Path, keep: bool, echo: Echo, plugin: dict[str, Any] | None) -> int:
    mesh = build_mesh(base)
    if plugin is not None:
        mesh.update_mesh(wasmPlugins=[plugin])
    a, b = mesh.workload("a"), mesh.workload("b")
    started = time.monotonic()

    def step(text: str) -> None:
        echo(f"[{time.monotonic() - started:5.1f}s] {text}")

    try:
        step(
            f"local control plane (CA + ADS) on 127.0.0.1:{mesh.secure_port} (TLS), mesh file {mesh.mesh_file}"
        )
        mesh.start_controlplane()
        for workload in (b, a):
            role = (
                f"inbound mTLS on 127.0.0.1:{workload.ports['inbound']} -> app :{workload.ports['app']}"
                if workload.backs
                else f"calls b via 127.0.0.1:{workload.outbound_port('b')}"
            )
            step(
                f"workload {workload.name}: echo app, pilot-agent and Envoy (admin :{workload.ports['admin']}; {role})"
            )
            mesh.start_workload(workload)
        step("waiting for each Envoy to get its certificate over SDS and its config over ADS ...")
        mesh.wait_for_config(
            b, lambda names: any(n.startswith("inbound_") for n in names["listeners"]), "inbound"
        )
        port = a.outbound_port("b")
        mesh.wait_for_config(a, lambda names: f"127.0.0.1_{port}" in names["listeners"], "its listener for b")
        wait_until(lambda: mesh.processes.alive() and _answers(port), 30, "a's first request to b")
        step(f"a calls http://b.default.svc.cluster.local:8000/hello through its Envoy (127.0.0.1:{port})")
        status, response_headers, answer = call_with_headers(port)
        headers = {name.lower(): value for name, value in answer.get("headers", {}).items()}

        echo("")
        rows = [("WORKLOAD", "SPIFFE IDENTITY", "CERTIFICATE EXPIRES")]
        for workload in (a, b):
            identity, expires = certificate(workload.ports["admin"])
            rows.append((workload.name, identity or "(none)", _expiry(expires)))
        _table(rows, echo)
        echo("")
        echo(
            f"  response to a's request: HTTP {status} from app {answer.get('app')!r}, path {answer.get('path')}"
        )
        echo("  caller identity b's Envoy verified (x-forwarded-client-cert):")
        for part in headers.get("x-forwarded-client-cert", "(missing)").split(";"):
            echo(f"    {part}")
        echo("")
        if plugin is not None:
            _show_plugin(plugin, response_headers, (a, b), echo)
        dns_port = a.ports["dns"]
        echo(f"  a's DNS proxy (127.0.0.1:{dns_port}, name table from the control plane over NDS):")
        rows = [("QUESTION", "ANSWER", "FLAGS")]
        for name in ("b.", "b.default.", "b.default.svc.cluster.local."):
            found = lookup("127.0.0.1", dns_port, name)
            if found is None:
                rows.append((name, "(no answer)", ""))
                continue
            addresses = ", ".join(f"{r.value} (TTL {r.ttl})" for r in found.answers) or "(none)"
            rows.append((name, addresses, "authoritative" if found.authoritative else ""))
        _table(rows, echo)
        echo("")
        echo("  config each Envoy holds (received over ADS through its agent):")
        rows = [("WORKLOAD", "KIND", "NAMES")]
        for workload in (a, b):
            names = dynamic_names(workload.ports["admin"])
            for kind in ("listeners", "clusters", "routes"):
                rows.append((workload.name, kind, ", ".join(names[kind]) or "-"))
        _table(rows, echo)
        echo("")
        if keep:
            pids = " ".join(str(process.pid) for process in mesh.processes.children.values())
            echo(f"left running in {base} (logs there); stop with: kill {pids}")
            mesh.processes.children.clear()
        return 0
    finally:
        if mesh.processes.children:
            codes = mesh.stop()
            echo("stopped: " + ", ".join(f"{name} (exit {code})" for name, code in codes.items()))


def _show_plugin(
    plugin: dict[str, Any], headers: dict[str, str], workloads: Sequence[Any], echo: Echo
) -> None:
    """The plugin's header on a's response, and the local file each Envoy runs it from."""
    echo(f"  WasmPlugin {plugin['namespace']}/{plugin['name']} ({plugin['url']}, fetched by each agent):")
    echo(f"    x-wasm-plugin on the response: {headers.get('x-wasm-plugin', '(missing)')}")
    rows = [("WORKLOAD", "ECDS FILTER", "MODULE RUN FROM")]
    for workload in workloads:
        dump = admin_json(workload.ports["admin"], "/config_dump?resource=ecds_filters")
        for entry in dump.get("configs", []):
            config = entry.get("ecds_filter", {})
            code = config.get("typed_config", {}).get("config", {}).get("vm_config", {}).get("code", {})
            source = code.get("local", {}).get("filename") or config.get("typed_config", {}).get("@type", "?")
            rows.append((workload.name, config.get("name", "?"), source))
    _table(rows, echo)
    echo("")


def demo(keep: bool, echo: Echo, wasm: Path | None = None) -> int:
    base = Path(tempfile.mkdtemp(prefix="ia-demo-", dir="/tmp"))
    try:
        return run_demo(base, keep, echo, wasm)
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
