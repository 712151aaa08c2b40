"""End to end: ``pilot-agent`` as the ``istio-proxy`` container Istio's injector adds to a pod.

The container runs in the proxy image ``make images`` builds (its root unpacked from the archive, its
ENV: what ships), as uid 1337 with no capabilities, on a read-only root, only the injector's volumes
writable, with the injector's args and env, cwd ``/`` and the hooks run as the kubelet runs them; the
local control plane is ``istiod.istio-system.svc`` on 15010/15012 (see tests/e2e/pod.py and
tests/e2e/injector.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import dns.exception
import dns.rcode
import pytest

from istio_agent.ctl.local import wait_until
from tests.e2e.injector import PROXY_UID, Istiod, istio_proxy, log_problems, mesh_for
from tests.e2e.pod import Container, Image, Pod, Running, children, process_status, unsupported
from tests.images.built import unavailable

CANNOT_RUN = unsupported() or unavailable("proxyv2")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(120),
    pytest.mark.skipif(CANNOT_RUN is not None, reason=CANNOT_RUN or ""),
]

NAME_TABLE = {"db.example.com": {"ips": ["10.10.0.7"], "registry": "External"}}
DNS_CAPTURE = {"ISTIO_META_DNS_CAPTURE": "true"}
SAVED_TABLE = "dns-name-table.pb"


@pytest.fixture
def istiod(pod: Pod) -> Istiod:
    control_plane = Istiod(pod, mesh_for(pod, nameTable=NAME_TABLE))
    control_plane.start()
    return control_plane


def proxy_image() -> Image:
    """The proxy image as the injected container runs it (``runAsUser``/``runAsGroup`` 1337)."""
    return Image.of_built("proxyv2", uid=PROXY_UID, gid=PROXY_UID)


def sidecar(pod: Pod, istiod: Istiod, **kwargs: Any) -> Container:
    """The injector's ``istio-proxy`` container (tests/e2e/injector.py), run from the proxy image."""
    return replace(istio_proxy(pod, istiod, **kwargs), image=proxy_image())


def addresses(pod: Pod, name: str, rdtype: str = "A", *, tcp: bool = False) -> list[str]:
    answer = pod.ask_dns(name, rdtype, tcp=tcp)
    assert answer.rcode() == dns.rcode.NOERROR, f"{name}: {dns.rcode.to_text(answer.rcode())}"
    return sorted(item.to_text() for rrset in answer.answer for item in rrset)


def resolves(pod: Pod, name: str, expected: list[str]) -> bool:
    try:
        return addresses(pod, name) == expected
    except (OSError, dns.exception.Timeout, AssertionError):  # not listening yet, or SERVFAIL
        return False


def assert_clean_log(container: Running) -> None:
    """No permission or read-only errors, and every line in Istio's log format (the agent's and Envoy's)."""
    not_allowed, grpc_core, unformatted = log_problems(container.log.read_text(errors="replace"))
    assert not not_allowed, "permission / read-only lines:\n" + "\n".join(not_allowed)
    assert not unformatted, "lines not in Istio's log format:\n" + "\n".join(unformatted)
    assert not grpc_core, "grpc C-core lines outside Istio's log format:\n" + "\n".join(grpc_core)


def assert_runs_as_the_proxy_user(pid: int) -> None:
    status = process_status(pid)
    assert status["Uid"].split() == ["1337"] * 4 and status["Gid"].split() == ["1337"] * 4
    assert status["Groups"] == "1337" or status["Groups"] == ""
    assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0
    assert status["NoNewPrivs"] == "1"


def assert_runs_in_the_image(container: Running) -> None:
    """The agent is the image's (its venv's Python, which this machine lacks), chroot-ed in its root."""
    argv = Path(f"/proc/{container.pid}/cmdline").read_bytes().split(b"\0")
    assert argv[:2] == [b"/opt/istio-agent/bin/python", b"/usr/local/bin/pilot-agent"], argv
    assert os.readlink(f"/proc/{container.pid}/root") == str(container.output("root"))


def written_files(volume: Path) -> list[str]:
    return sorted(str(path.relative_to(volume)) for path in volume.rglob("*"))


def test_the_injected_sidecar_starts_serves_dns_and_drains_on_a_read_only_root(
    pod: Pod, istiod: Istiod
) -> None:
    running = pod.start_container(sidecar(pod, istiod, proxy_metadata=DNS_CAPTURE, grace_period=10))
    pod.wait_ready("istio-proxy")  # postStart: pilot-agent wait on 15020's /healthz/ready
    assert pod.http("GET", 15021, "/healthz/ready")[0] == 200  # the kubelet's probe, through Envoy

    assert_runs_in_the_image(running)
    assert_runs_as_the_proxy_user(running.pid)
    envoy = children(running.pid)
    assert (
        len(envoy) == 1
        and Path(f"/proc/{envoy[0]}/cmdline").read_bytes().split(b"\0")[0] == b"/usr/local/bin/envoy"
    )
    assert_runs_as_the_proxy_user(envoy[0])

    host = f"{pod.name}.{pod.namespace}.svc.cluster.local."
    assert addresses(pod, host) == [pod.ip]
    assert addresses(pod, f"{pod.name}.", tcp=True) == [pod.ip]  # the short name in its own namespace
    assert addresses(pod, "db.example.com.") == ["10.10.0.7"]

    # every file the agent and Envoy write is on one of the pod's volumes (the root refuses any other)
    # as Istio, every sidecar also writes the proxyless gRPC bootstrap (GRPC_XDS_BOOTSTRAP defaults on)
    assert written_files(pod.volume("istio-envoy")) == ["XDS", "envoy-rev.json", "grpc-bootstrap.json"]
    assert written_files(pod.volume("workload-socket")) == ["socket"]
    assert written_files(pod.volume("istio-data")) == [SAVED_TABLE]
    assert (pod.volume("istio-data") / SAVED_TABLE).stat().st_uid == 1337
    for volume in ("credential-socket", "workload-certs"):
        assert written_files(pod.volume(volume)) == []

    stopping = time.monotonic()
    assert pod.stop_container("istio-proxy") == 0  # preStop (drain), then SIGTERM
    took = time.monotonic() - stopping
    assert running.pre_stop_code == 0 and running.output("pre-stop.log").read_text().strip() == "OK"
    log = running.log.read_text()
    assert (
        "handling /drain, starting Envoy listener drain" in log
        and "Agent already drained, exiting immediately" in log
    )
    assert took < 5, f"the drain was done by preStop; SIGTERM should exit at once, took {took:.1f}s"
    assert "drain request" not in log  # no failed drain request to Envoy
    assert_clean_log(running)


def test_a_restarted_container_answers_from_the_table_on_its_istio_data_volume(
    pod: Pod, istiod: Istiod
) -> None:
    pod.start_container(sidecar(pod, istiod, proxy_metadata=DNS_CAPTURE, grace_period=10))
    pod.wait_ready("istio-proxy")
    host = f"{pod.name}.{pod.namespace}.svc.cluster.local."
    assert addresses(pod, host) == [pod.ip]
    first = pod.containers["istio-proxy"]

    istiod.stop(kill=True)
    pod.kill_container("istio-proxy")  # a crash: the container's PID 1 dies, Envoy with it
    restarted = pod.restart_container("istio-proxy")  # same volumes, stale sockets left on them
    try:
        wait_until(lambda: resolves(pod, host, [pod.ip]), 20, "the saved name table to answer")
    except TimeoutError as err:
        raise TimeoutError(f"{err}\n{pod.describe('istio-proxy')}") from None
    assert addresses(pod, "db.example.com.") == ["10.10.0.7"]
    assert "answering from the saved DNS name table (2 hosts)" in restarted.log.read_text()
    assert pod.http("GET", 15020, "/healthz/ready")[0] == 503  # still waiting for this run's config

    istiod.start()
    pod.wait_ready("istio-proxy")  # the restarted container's postStart hook
    assert pod.stop_container("istio-proxy") == 0
    assert_clean_log(first)
    assert_clean_log(restarted)


@pytest.mark.parametrize(
    ("volume", "fault", "error"),
    [
        (
            "istio-envoy",
            "missing",
            "xDS proxy could not listen on /etc/istio/proxy/XDS: [Errno 30] Read-only file system: '/etc/istio/proxy'",
        ),
        (
            "istio-envoy",
            "mounted read-only",
            "xDS proxy could not listen on /etc/istio/proxy/XDS: "
            "failed to remove existing file at /etc/istio/proxy/XDS: Read-only file system",
        ),
        (
            "workload-socket",
            "not writable by 1337",
            "SDS server could not listen on /var/run/secrets/workload-spiffe-uds/socket: [Errno 13] Permission denied",
        ),
    ],
    ids=["istio-envoy-missing", "istio-envoy-read-only", "workload-socket-not-writable"],
)
def test_without_a_writable_volume_the_agent_exits_naming_the_path(
    pod: Pod, istiod: Istiod, volume: str, fault: str, error: str
) -> None:
    spec = sidecar(pod, istiod)
    if fault == "missing":
        spec.mounts = [m for m in spec.mounts if m.volume != volume]
    elif fault == "mounted read-only":
        spec.mounts = [replace(m, read_only=True) if m.volume == volume else m for m in spec.mounts]
    else:
        pod.volume(volume).chmod(0o755)  # e.g. a hostPath instead of an emptyDir: root's, not the proxy's
    running = pod.start_container(spec)
    assert pod.wait_exit("istio-proxy", 20) == 255
    assert error in running.log.read_text(), pod.describe("istio-proxy")
