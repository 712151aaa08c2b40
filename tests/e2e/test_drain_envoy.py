"""End to end: what a sidecar's real Envoy does with connections while the agent drains it after SIGTERM.

Istio's pilot-agent (pkg/envoy/agent.go, pkg/envoy/proxy.go at 1.28) answers SIGTERM by POSTing
``/drain_listeners?inboundonly&graceful`` to Envoy, which was started with ``--drain-time-s
<drainDuration> --drain-strategy immediate``; it then waits terminationDrainDuration and kills Envoy
(with EXIT_ON_ZERO_ACTIVE_CONNECTIONS: MINIMUM_DRAIN_DURATION, then until Envoy counts no connection).
Envoy's documented graceful drain (docs: intro/arch_overview/operations/draining) discourages
requests at once (``immediate``: every HTTP/1.1 answer on an inbound listener says ``Connection:
close``) while still accepting new connections for ``--drain-time-s``, then stops the inbound
listeners: from then on a new inbound connection is refused. Outbound listeners are not drained.

Workload ``b`` backs service ``b`` and calls service ``c``; the tests talk to ``b``'s inbound
listener directly over mTLS with a certificate from the local CA, so they decide exactly which
connection is old and which is new. With drainDuration 2 s and terminationDrainDuration 5 s the end
state (inbound listener closed, Envoy still running) is observable for about 3 s. The other tests
cover EXIT_ON_ZERO_ACTIVE_CONNECTIONS and the native sidecars' ``/drain`` (``skip_exit``) path.
"""

from __future__ import annotations

import http.client
import json
import signal
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from istio_agent.controlplane.ca import LocalCA
from istio_agent.ctl.local import wait_until
from istio_agent.ctl.localmesh import LocalMesh, Service, Workload
from istio_agent.security.keys import KeyOptions, generate_csr
from tests.e2e.test_lifecycle import envoy_pid
from tests.procs import running

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

DRAIN = 2.0  # drainDuration: Envoy's --drain-time-s
TERMINATION = 5.0  # terminationDrainDuration: how long the agent lets Envoy drain before killing it
CALLER = "spiffe://cluster.local/ns/default/sa/sleep"


@pytest.fixture
def mesh(short_tmp: Path) -> Iterator[LocalMesh]:
    local = LocalMesh(
        short_tmp,
        [Service("b", 8000), Service("c", 9000)],
        [
            Workload("b", short_tmp / "b", backs=["b"], calls=["c"]),
            Workload("c", short_tmp / "c", backs=["c"]),
        ],
    )
    try:
        yield local
    finally:
        local.stop()


def start_b(mesh: LocalMesh, b: Workload, drain: float, termination: float, **env: str) -> None:
    """b's echo app and its agent, with short drain durations."""
    b.workdir.mkdir(parents=True, exist_ok=True)
    mesh.processes.start("app b", b.app_command(), b.workdir / "app.log")
    proxy_config = {
        "discoveryAddress": mesh.discovery_address,
        "proxyAdminPort": b.ports["admin"],
        "statusPort": b.ports["status"],
        "drainDuration": f"{drain:g}s",
        "terminationDrainDuration": f"{termination:g}s",
    }
    mesh.start_agent(b, PROXY_CONFIG=json.dumps(proxy_config), **env)


def serving(mesh: LocalMesh, context: ssl.SSLContext) -> None:
    """Wait until b's inbound listener serves mTLS and b's outbound listener reaches c."""
    b, c = mesh.workload("b"), mesh.workload("c")
    mesh.wait_for_config(c, lambda seen: any(n.startswith("inbound_") for n in seen["listeners"]), "inbound")
    mesh.wait_for_config(
        b,
        lambda seen: (
            any(n.startswith("inbound_") for n in seen["listeners"])
            and f"127.0.0.1_{b.outbound_port('c')}" in seen["listeners"]
        ),
        "its inbound and outbound listeners",
    )
    inbound = b.ports["inbound"]
    wait_until(lambda: new_inbound(context, inbound) == "served", 30, "b's inbound listener to serve mTLS")
    wait_until(lambda: outbound_call(b.outbound_port("c")) == (200, "", "c"), 30, "b to reach c")


def log_of(workload: Workload) -> str:
    return (workload.workdir / "agent.log").read_text()


def client_context(mesh: LocalMesh) -> ssl.SSLContext:
    """An mTLS client with a workload certificate from the mesh's CA (b's inbound listener requires one)."""
    csr, key = generate_csr(CALLER, KeyOptions(ecc_signature_algorithm="ECDSA"))
    chain = LocalCA.load_or_create(mesh.state_dir, "cluster.local").sign_csr(csr, CALLER, timedelta(hours=1))
    (mesh.base / "client-chain.pem").write_text("".join(c if c.endswith("\n") else c + "\n" for c in chain))
    (mesh.base / "client-key.pem").write_bytes(key)
    context = ssl.create_default_context(cafile=str(mesh.state_dir / "root-cert.pem"))
    context.check_hostname = False  # workload certificates carry a SPIFFE URI, no DNS name
    context.load_cert_chain(mesh.base / "client-chain.pem", mesh.base / "client-key.pem")
    return context


def get(connection: http.client.HTTPConnection) -> tuple[int, str, dict[str, object]]:
    """One GET /hello on ``connection``: status, its Connection header, the echo app's answer."""
    connection.request("GET", "/hello")
    response = connection.getresponse()
    body = json.loads(response.read())
    return response.status, (response.getheader("connection") or "").lower(), body


def new_inbound(context: ssl.SSLContext, port: int) -> str:
    """What a brand-new inbound connection gets: ``served``, ``served+close``, ``refused`` or ``closed``."""
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=5)
    try:
        status, header, _ = get(connection)
    except ConnectionRefusedError:
        return "refused"
    except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected, ssl.SSLError):
        return "closed"
    finally:
        connection.close()
    assert status == 200
    return "served+close" if header == "close" else "served"


def outbound_call(port: int) -> tuple[int, str, str]:
    """A new connection to b's outbound listener for c: status, Connection header, which app answered."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        status, header, answer = get(connection)
    finally:
        connection.close()
    return status, header, str(answer["app"])


def envoy_readiness(port: int) -> int | str:
    """What kubelet's probe gets from Envoy's readiness listener (15021): a status or ``refused``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz/ready", timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return "refused"


def admin_up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1):
            return True
    except OSError:
        return False


def test_after_sigterm_new_inbound_connections_are_refused_old_ones_and_outbound_still_work(
    mesh: LocalMesh,
) -> None:
    b, c = mesh.workload("b"), mesh.workload("c")
    mesh.start_controlplane()
    mesh.start_workload(c)
    start_b(mesh, b, DRAIN, TERMINATION)
    context = client_context(mesh)
    serving(mesh, context)
    agent = mesh.processes.children["pilot-agent b"]
    inbound = b.ports["inbound"]
    envoy = envoy_pid(agent.pid)
    assert envoy is not None

    old = http.client.HTTPSConnection("127.0.0.1", inbound, context=context, timeout=5)
    status, header, answer = get(old)
    assert (status, header, answer["app"]) == (200, "", "b")  # a kept-alive connection, before SIGTERM
    old_socket = old.sock
    wait_until(lambda: envoy_readiness(b.ports["envoy_status"]) == 200, 30, "b ready through Envoy's 15021")

    agent.send_signal(signal.SIGTERM)
    signalled = time.monotonic()

    # New inbound connections, one after another, until Envoy refuses them.
    seen: list[tuple[float, str]] = []
    while time.monotonic() - signalled < TERMINATION + 2:
        outcome = new_inbound(context, inbound)
        seen.append((time.monotonic() - signalled, outcome))
        if outcome == "refused":
            break
        time.sleep(0.1)
    outcomes = [outcome for _, outcome in seen]
    assert outcomes[-1] == "refused", seen
    refused_after = seen[-1][0]
    # Accepted (and told to close) during --drain-time-s, refused once Envoy stopped its inbound listeners.
    assert "served+close" in outcomes, seen
    assert "closed" not in outcomes, seen
    # drain-strategy immediate: from the moment the drain begins, every new connection is told to close
    # (with "gradual" Envoy 1.40 here started doing so only half way through --drain-time-s).
    first_drained = outcomes.index("served+close")
    assert seen[first_drained][0] < DRAIN / 2, seen
    assert set(outcomes[first_drained:-1]) == {"served+close"}, seen
    assert DRAIN - 0.1 <= refused_after < TERMINATION, seen

    # The end state, within the drain window: the agent and its Envoy still run.
    assert agent.poll() is None
    # kubelet's probe through Envoy fails: the agent's status port closed; Envoy's 15021 listener answers.
    assert envoy_readiness(b.ports["envoy_status"]) == 503
    assert running(envoy)
    assert new_inbound(context, inbound) == "refused"
    status, header, answer = get(old)  # the connection made before SIGTERM still carries a request
    assert old.sock is old_socket or old.sock is None  # not a reconnect (that would have been refused)
    assert (status, answer["app"]) == (200, "b")
    assert header == "close"  # ... and is told to close (drain-strategy immediate)
    # Outbound listeners are not drained (inboundonly): served, and not even told to close.
    assert outbound_call(b.outbound_port("c")) == (200, "", "c")
    assert agent.poll() is None and time.monotonic() - signalled < TERMINATION

    # After terminationDrainDuration the agent kills Envoy and exits cleanly.
    code = agent.wait(15)
    stopped_after = time.monotonic() - signalled
    assert code == 0
    assert TERMINATION - 0.5 <= stopped_after < TERMINATION + 5
    assert not running(envoy)
    assert not admin_up(b.ports["admin"])
    text = log_of(b)
    assert "Agent draining Proxy for termination" in text
    assert f"Graceful termination period is {TERMINATION:g}s" in text
    assert "Envoy aborted normally" in text
    assert "drain request" not in text  # the drain request reached Envoy and was accepted


def test_exit_on_zero_active_connections_waits_for_the_last_inbound_connection(mesh: LocalMesh) -> None:
    """EXIT_ON_ZERO_ACTIVE_CONNECTIONS: after MINIMUM_DRAIN_DURATION the agent polls Envoy's stats and
    stops as soon as no inbound connection is left, long before terminationDrainDuration."""
    b, c = mesh.workload("b"), mesh.workload("c")
    mesh.start_controlplane()
    mesh.start_workload(c)
    minimum, drain, termination = 0.5, 20.0, 60.0  # drainDuration: this agent's bound on the wait
    start_b(
        mesh, b, drain, termination, EXIT_ON_ZERO_ACTIVE_CONNECTIONS="true", MINIMUM_DRAIN_DURATION="500ms"
    )
    context = client_context(mesh)
    serving(mesh, context)
    agent = mesh.processes.children["pilot-agent b"]
    inbound = b.ports["inbound"]
    envoy = envoy_pid(agent.pid)
    assert envoy is not None
    old = http.client.HTTPSConnection("127.0.0.1", inbound, context=context, timeout=5)
    assert get(old)[:2] == (200, "")

    agent.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    # Within --drain-time-s (20 s) new inbound connections are still accepted, and told to close.
    wait_until(lambda: new_inbound(context, inbound) == "served+close", 5, "b's Envoy to start draining")
    # The idle connection from before SIGTERM is still open: Envoy counts it, the agent keeps waiting.
    wait_until(lambda: "There are still 1 active connections" in log_of(b), 10, "a poll that counts it")
    assert agent.poll() is None and running(envoy)
    assert time.monotonic() - signalled >= minimum

    status, header, answer = get(old)  # still served; the answer says close and Envoy closes it
    assert (status, header, answer["app"]) == (200, "close", "b")
    old.close()
    closed = time.monotonic()
    code = agent.wait(15)
    assert code == 0
    assert (
        time.monotonic() - closed < 5
    )  # the next poll or two, not drainDuration or terminationDrainDuration
    assert not running(envoy)
    text = log_of(b)
    # Istio's lines for this path (pkg/envoy/agent.go terminate()), and not the timer path's "complete".
    assert "Agent draining proxy for 500ms, then waiting for active connections to terminate..." in text
    assert "Checking for active connections..." in text
    assert "There are no more active connections. terminating proxy..." in text
    assert "Graceful termination period complete" not in text
    assert "Envoy aborted normally" in text
    assert "after the drain began" not in text  # not this agent's drainDuration bound


def test_drain_endpoint_drains_forever_and_the_next_sigterm_stops_at_once(mesh: LocalMesh) -> None:
    """Native sidecars: preStop POSTs the status port's ``/drain`` (``...&skip_exit``): Envoy keeps
    discouraging inbound requests but, past --drain-time-s, still accepts new connections (Istio:
    "we start draining, forever"); the SIGTERM that follows kills Envoy without waiting again."""
    b, c = mesh.workload("b"), mesh.workload("c")
    mesh.start_controlplane()
    mesh.start_workload(c)
    start_b(mesh, b, DRAIN, TERMINATION)
    context = client_context(mesh)
    serving(mesh, context)
    agent = mesh.processes.children["pilot-agent b"]
    inbound = b.ports["inbound"]
    envoy = envoy_pid(agent.pid)
    assert envoy is not None

    request = urllib.request.Request(f"http://127.0.0.1:{b.ports['status']}/drain", method="POST")
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 200
    drained = time.monotonic()
    wait_until(lambda: new_inbound(context, inbound) == "served+close", 5, "b's Envoy to start draining")
    time.sleep(max(0.0, drained + DRAIN + 1 - time.monotonic()))  # past --drain-time-s
    assert new_inbound(context, inbound) == "served+close"  # skip_exit: the listener is never stopped
    assert outbound_call(b.outbound_port("c")) == (200, "", "c")
    assert agent.poll() is None

    agent.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert agent.wait(15) == 0
    assert time.monotonic() - signalled < TERMINATION - 1  # no second drain period
    assert not running(envoy)
    text = log_of(b)
    assert "Envoy aborted normally" in text
    assert "Graceful termination period is" not in text
