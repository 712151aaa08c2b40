"""Readiness probers against a scripted fake Envoy admin API (and once against a real Envoy)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from istio_agent.ctl.local import free_port
from istio_agent.ctl.static_mtls import direct_response_bootstrap
from istio_agent.envoy.binary import find_envoy
from istio_agent.envoy.readiness import CONFIG_FILTER, LIVE_FILTER, EnvoyReadiness, parse_stats
from istio_agent.metrics import Registry
from istio_agent.status.readiness import DNS_NOT_READY, DnsReadiness, GrpcBootstrapReadiness, Readiness
from tests.aiohttp_apps import serve_app

FULL_CONFIG = (
    "cluster_manager.cds.update_rejected: 0\n"
    "cluster_manager.cds.update_success: 1\n"
    "listener_manager.lds.update_rejected: 0\n"
    "listener_manager.lds.update_success: 1\n"
)
LIVE = "listener_manager.workers_started: 1\nserver.state: 0\n"


class FakeAdmin:
    """Envoy's admin ``/stats`` with scripted bodies for the config and the live filters."""

    def __init__(self) -> None:
        self.config_body = FULL_CONFIG
        self.live_body = LIVE
        self.status = 200
        self.hang = False
        self.requests: list[dict[str, str]] = []
        self.port = 0

    async def stats(self, request: web.Request) -> web.Response:
        self.requests.append(dict(request.query))
        if self.hang:
            await asyncio.Event().wait()
        if "usedonly" not in request.query:
            return web.Response(status=400, text="usedonly missing")
        body = self.live_body if request.query.get("filter") == LIVE_FILTER else self.config_body
        if request.query.get("filter") not in (LIVE_FILTER, CONFIG_FILTER):
            return web.Response(status=400, text="unexpected filter")
        return web.Response(status=self.status, text=body)

    def count(self, pattern: str) -> int:
        return sum(1 for query in self.requests if query.get("filter") == pattern)


@pytest.fixture
async def admin() -> AsyncIterator[FakeAdmin]:
    fake = FakeAdmin()
    app = web.Application()
    app.router.add_get("/stats", fake.stats)
    runner, fake.port = await serve_app(app, shutdown_timeout=0.1)
    try:
        yield fake
    finally:
        await runner.cleanup()


def probe(
    admin: FakeAdmin, started_at: float | None = None, registry: Registry | None = None
) -> EnvoyReadiness:
    return EnvoyReadiness(
        "127.0.0.1",
        admin.port,
        started_at=time.monotonic() if started_at is None else started_at,
        registry=registry or Registry(),
    )


# -- Envoy probe: config stage -----------------------------------------------------------------------
async def test_full_stats_are_ready_and_record_startup_duration(admin: FakeAdmin) -> None:
    registry = Registry()
    envoy = probe(admin, started_at=time.monotonic() - 1000, registry=registry)
    assert await envoy.check() is None
    assert (registry.sample("istio_agent_startup_duration_seconds") or 0) >= 1000
    assert admin.count(CONFIG_FILTER) == 1 and admin.count(LIVE_FILTER) == 1


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "",
            "config not received from XDS server (is Istiod running?): "
            "cds updates: 0 successful, 0 rejected; lds updates: 0 successful, 0 rejected",
        ),
        (
            "listener_manager.lds.update_success: 1\n",
            "config not fully received from XDS server: "
            "cds updates: 0 successful, 0 rejected; lds updates: 1 successful, 0 rejected",
        ),
        (
            "cluster_manager.cds.update_success: 1\n",
            "config not fully received from XDS server: "
            "cds updates: 1 successful, 0 rejected; lds updates: 0 successful, 0 rejected",
        ),
        (
            "cluster_manager.cds.update_rejected: 1\nlistener_manager.lds.update_success: 1\n",
            "config received from XDS server, but was rejected: "
            "cds updates: 0 successful, 1 rejected; lds updates: 1 successful, 0 rejected",
        ),
        (
            "cluster_manager.cds.update_success: 3\nlistener_manager.lds.update_rejected: 2\n",
            "config received from XDS server, but was rejected: "
            "cds updates: 3 successful, 0 rejected; lds updates: 0 successful, 2 rejected",
        ),
        (
            # nothing succeeded: "not received" wins over "rejected"
            "cluster_manager.cds.update_rejected: 4\nlistener_manager.lds.update_rejected: 5\n",
            "config not received from XDS server (is Istiod running?): "
            "cds updates: 0 successful, 4 rejected; lds updates: 0 successful, 5 rejected",
        ),
    ],
)
async def test_config_error_strings(admin: FakeAdmin, body: str, expected: str) -> None:
    admin.config_body = body
    assert await probe(admin).check() == expected
    assert admin.count(LIVE_FILTER) == 0  # the live stage is not reached


# -- Envoy probe: live stage -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("", "server.state is not yet updated: "),
        (
            "listener_manager.workers_started: 1\n",
            "server.state is not yet updated: listener_manager.workers_started: 1",
        ),
        ("server.state: 0\n", "listener_manager.workers_started is not yet updated: server.state: 0"),
        (LIVE.replace("state: 0", "state: 1"), "server is not live, current state is: DRAINING"),
        (LIVE.replace("state: 0", "state: 2"), "server is not live, current state is: PRE_INITIALIZING"),
        (LIVE.replace("state: 0", "state: 3"), "server is not live, current state is: INITIALIZING"),
        (LIVE.replace("state: 0", "state: 9"), "server is not live, current state is: UNKNOWN"),
        ("listener_manager.workers_started: 0\nserver.state: 0\n", "workers have not yet started"),
    ],
)
async def test_live_error_strings(admin: FakeAdmin, body: str, expected: str) -> None:
    admin.live_body = body
    assert await probe(admin).check() == expected


async def test_each_stage_is_cached_once_passed(admin: FakeAdmin) -> None:
    envoy = probe(admin)
    admin.live_body = "server.state: 3\nlistener_manager.workers_started: 0\n"
    assert await envoy.check() == "server is not live, current state is: INITIALIZING"
    admin.config_body = ""  # config stage already passed: not asked again
    admin.live_body = LIVE
    assert await envoy.check() is None
    assert admin.count(CONFIG_FILTER) == 1
    admin.status, admin.live_body = 500, ""
    for _ in range(3):
        assert await envoy.check() is None
    assert admin.count(CONFIG_FILTER) == 1 and admin.count(LIVE_FILTER) == 2


async def test_admin_errors_are_readable(admin: FakeAdmin) -> None:
    admin.status = 503
    assert await probe(admin).check() == "failed to get Envoy stats: HTTP status code 503"
    admin.status, admin.config_body = 200, "cluster_manager.cds.update_success: lots\n"
    assert (
        await probe(admin).check() == "failed to parse Envoy stat 'cluster_manager.cds.update_success: lots'"
    )


async def test_closed_admin_port_is_an_error_not_a_crash() -> None:
    envoy = EnvoyReadiness("127.0.0.1", free_port(), started_at=time.monotonic(), registry=Registry())
    error = await envoy.check()
    assert error is not None and error.startswith("failed to get Envoy stats: ")


async def test_config_request_times_out_after_one_second(admin: FakeAdmin) -> None:
    admin.hang = True
    started = time.monotonic()
    assert await probe(admin).check() == "failed to get Envoy stats: timeout after 1s"
    assert time.monotonic() - started < 2.5


async def test_ipv6_admin_host() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    fake = FakeAdmin()
    app = web.Application()
    app.router.add_get("/stats", fake.stats)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "::1", 0)
        try:
            await site.start()
        except OSError:
            pytest.skip("cannot bind ::1")
        port = runner.addresses[0][1]
        assert (
            await EnvoyReadiness("::1", port, started_at=time.monotonic(), registry=Registry()).check()
            is None
        )
    finally:
        await runner.cleanup()


def test_parse_stats_first_line_wins_and_missing_is_zero() -> None:
    body = "server.state: 2\nserver.state: 0\nunrelated: x\n"
    assert parse_stats(body, ("server.state", "listener_manager.workers_started")) == {
        "server.state": 2,
        "listener_manager.workers_started": 0,
    }


# -- other probers -----------------------------------------------------------------------------------
async def test_dns_readiness_follows_the_table() -> None:
    state = {"ready": False}
    dns = DnsReadiness(lambda: state["ready"])
    assert await dns.check() == DNS_NOT_READY
    assert DNS_NOT_READY == "istio DNS capture is turned ON and DNS lookup table is not ready yet"
    state["ready"] = True
    assert await dns.check() is None


async def test_grpc_bootstrap_readiness(tmp_path: Path) -> None:
    path = tmp_path / "grpc-bootstrap.json"
    probe_ = GrpcBootstrapReadiness(path)
    error = await probe_.check()
    assert error is not None and error.startswith(f"failed loading {path}: ")
    path.write_text("{not json")
    error = await probe_.check()
    assert error is not None and error.startswith(f"failed loading {path}: ")
    cert, key, ca = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "root.pem"
    provider = {
        "plugin_name": "file_watcher",
        "config": {
            "certificate_file": str(cert),
            "private_key_file": str(key),
            "ca_certificate_file": str(ca),
        },
    }
    path.write_text(json.dumps({"xds_servers": [], "certificate_providers": {"default": provider}}))
    assert await probe_.check() == f"{cert} does not exist"
    cert.write_text("c")
    key.write_text("k")
    assert await probe_.check() == f"{ca} does not exist"
    ca.write_text("r")
    assert await probe_.check() is None
    path.unlink()  # loading is cached after success
    assert await probe_.check() is None


async def test_grpc_bootstrap_without_file_watcher(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"certificate_providers": {"x": {"plugin_name": "other"}}}))
    assert await GrpcBootstrapReadiness(path).check() is None


# -- the chain -----------------------------------------------------------------------------------------
class Scripted:
    def __init__(self, error: str | None = None) -> None:
        self.error = error
        self.calls = 0

    async def check(self) -> str | None:
        self.calls += 1
        return self.error


class Broken:
    async def check(self) -> str | None:
        raise KeyError("boom")


async def test_first_failure_wins() -> None:
    first, second, third = Scripted(), Scripted("second failed"), Scripted("third failed")
    readiness = Readiness([first, second, third])
    assert await readiness.check() == "second failed"
    assert (first.calls, second.calls, third.calls) == (1, 1, 0)
    second.error = None
    assert await readiness.check() == "third failed"
    third.error = None
    assert await readiness.check() is None
    assert await Readiness([]).check() is None


async def test_terminate_is_checked_before_everything(admin: FakeAdmin) -> None:
    prober = Scripted()
    readiness = Readiness([probe(admin), prober])
    assert await readiness.check() is None
    readiness.terminate("received signal terminated")
    readiness.terminate("a later cause is ignored")
    assert await readiness.check() == "server is terminated: received signal terminated"
    assert prober.calls == 1
    assert readiness.terminated


async def test_a_raising_prober_fails_readiness() -> None:
    readiness = Readiness([Broken(), Scripted("never reached")])
    assert await readiness.check() == "readiness check failed: KeyError: 'boom'"


async def test_logs_are_debounced(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="istio.healthcheck")
    prober = Scripted("not ready")
    readiness = Readiness([prober])

    def messages() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "istio.healthcheck"]

    for _ in range(3):
        assert await readiness.check() == "not ready"
    assert messages() == ["Envoy proxy is NOT ready: not ready"]
    prober.error = "still not ready"
    await readiness.check()
    prober.error = None
    await readiness.check()
    await readiness.check()
    prober.error = "not ready"
    await readiness.check()
    assert messages() == [
        "Envoy proxy is NOT ready: not ready",
        "Envoy proxy is NOT ready: still not ready",
        "Envoy proxy is ready",
        "Envoy proxy is NOT ready: not ready",
    ]
    assert [r.levelname for r in caplog.records if r.name == "istio.healthcheck"] == [
        "WARNING",
        "WARNING",
        "INFO",
        "WARNING",
    ]


# -- real Envoy ---------------------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.timeout(60)
async def test_real_envoy_without_xds_is_live_but_has_no_config(tmp_path: Path) -> None:
    admin_port = free_port()
    bootstrap = tmp_path / "envoy.json"
    bootstrap.write_text(json.dumps(direct_response_bootstrap(admin_port, free_port())))
    process = await asyncio.create_subprocess_exec(
        str(find_envoy()),
        "-c", str(bootstrap),
        "--disable-hot-restart",
        "-l", "error",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        envoy = EnvoyReadiness("127.0.0.1", admin_port, started_at=time.monotonic(), registry=Registry())
        deadline = time.monotonic() + 30
        live_error: str | None = "not checked"
        while time.monotonic() < deadline and process.returncode is None:
            live_error = await envoy.live_status()  # polls a separate process: nothing to await instead
            if live_error is None:
                break
            await asyncio.sleep(0.1)
        assert process.returncode is None, "Envoy exited early"
        assert live_error is None  # real server.state / workers_started output parsed as LIVE
        expected = (
            "config not received from XDS server (is Istiod running?): "
            "cds updates: 0 successful, 0 rejected; lds updates: 0 successful, 0 rejected"
        )
        assert await envoy.check() == expected
        assert await Readiness([envoy]).check() == expected
    finally:
        if process.returncode is None:
            process.kill()
        with contextlib.suppress(ProcessLookupError):
            await process.wait()
