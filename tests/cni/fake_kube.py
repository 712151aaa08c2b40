"""A FAKE Kubernetes API server for the istio-cni plugin's tests (a real one cannot run here).

HTTPS on 127.0.0.1 with a serving certificate from a test CA, answering only
``GET /api/v1/namespaces/{ns}/pods/{name}`` from a dict of pods, with a bearer token check. Tests
script failures per request (status codes, a hang) to check that the plugin fails closed. Built on
aiohttp, an HTTP stack independent of the plugin's own client.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from istio_agent.controlplane.ca import LocalCA

TOKEN = "fake-service-account-token-do-not-log"


@dataclass
class FakeKube:
    """The fake's state: the pods it serves, and what to answer instead (popped one per request)."""

    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    failures: list[int | str] = field(default_factory=list)
    """Per request, in order: an HTTP status to answer instead, or "hang" (never answer)."""
    requests: list[str] = field(default_factory=list)
    port: int = 0
    ca_pem: bytes = b""

    def add_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        self.pods[(meta["namespace"], meta["name"])] = pod

    def kubeconfig(self, *, insecure: bool = False, server: str | None = None) -> str:
        """The kubeconfig as install-cni writes it (its own renderer: JSON), pointing at this fake."""
        from istio_agent.cni.install import kubeconfig

        trust: dict[str, Any] = (
            {"insecure-skip-tls-verify": True}
            if insecure
            else {"certificate-authority-data": base64.b64encode(self.ca_pem).decode()}
        )
        cluster = {**trust, "server": server or f"https://127.0.0.1:{self.port}"}
        return kubeconfig.render(
            {
                "apiVersion": "v1",
                "clusters": [{"cluster": cluster, "name": kubeconfig.CLUSTER}],
                "contexts": [
                    {
                        "context": {"cluster": kubeconfig.CLUSTER, "user": kubeconfig.USER},
                        "name": kubeconfig.CONTEXT,
                    }
                ],
                "current-context": kubeconfig.CONTEXT,
                "kind": "Config",
                "preferences": {},
                "users": [{"name": kubeconfig.USER, "user": {"token": TOKEN}}],
            }
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(request.path)
        if self.failures:
            failure = self.failures.pop(0)
            if failure == "hang":
                await asyncio.sleep(3600)
            return web.json_response(
                {"kind": "Status", "message": f"fake failure {failure}", "code": failure}, status=int(failure)
            )
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"kind": "Status", "message": "Unauthorized", "code": 401}, status=401)
        key = (request.match_info["ns"], request.match_info["name"])
        pod = self.pods.get(key)
        if pod is None:
            message = f'pods "{key[1]}" not found'
            return web.json_response({"kind": "Status", "message": message, "code": 404}, status=404)
        return web.json_response(pod)


async def start_fake_kube(state_dir: Path) -> tuple[FakeKube, web.AppRunner]:
    """Serve a FakeKube on 127.0.0.1 (HTTPS, certificate for 127.0.0.1); the caller cleans the runner up."""
    ca = LocalCA.load_or_create(state_dir, "cluster.local")
    key_pem, chain_pem = ca.issue_serving_cert(["127.0.0.1"])
    (state_dir / "tls.key").write_bytes(key_pem)
    (state_dir / "tls.crt").write_bytes(chain_pem)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(state_dir / "tls.crt", state_dir / "tls.key")
    fake = FakeKube(ca_pem=ca.root_pem)
    app = web.Application()
    app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}", fake.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    fake.port = int(runner.addresses[0][1])
    return fake, runner


def sidecar_pod(
    name: str = "app-1",
    namespace: str = "default",
    *,
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    proxy_env: dict[str, str] | None = None,
    security_context: dict[str, Any] | None = None,
    extra_containers: list[dict[str, Any]] | None = None,
    init_containers: list[dict[str, Any]] | None = None,
    proxy_args: list[str] | None = None,
    proxy: bool = True,
) -> dict[str, Any]:
    """A pod as the injector leaves it for a CNI-enabled mesh (istio-validation, no istio-init)."""
    proxy_container: dict[str, Any] = {
        "name": "istio-proxy",
        "args": proxy_args if proxy_args is not None else ["proxy", "sidecar"],
        "env": [{"name": key, "value": value} for key, value in (proxy_env or {}).items()],
    }
    if security_context is not None:
        proxy_container["securityContext"] = security_context
    containers = [{"name": "app"}, *(extra_containers or [])]
    if proxy:
        containers.append(proxy_container)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": labels or {},
            "annotations": {
                "sidecar.istio.io/status": '{"containers":["istio-proxy"]}',
                **(annotations or {}),
            },
        },
        "spec": {
            "initContainers": init_containers
            if init_containers is not None
            else [{"name": "istio-validation"}],
            "containers": containers,
        },
    }
