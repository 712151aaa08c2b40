"""The ADD hand-over: the real istio-cni executable gives its ADD to the real install-cni process.

install-cni runs as a process on temp directories; its kubeconfig (written from the "service
account" the test lays out) points at the FAKE Kubernetes API server (``fake_kube.py``; no real one
runs here). The pods are network namespaces the test creates, and the rules are really applied.
Which process ran the ADD shows in the logs: the plugin's log line is in install-cni's output when
handed over, in the plugin's stderr when it ran the ADD itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from istio_agent.cni import handoff
from istio_agent.cni.handoff import SOCKET_NAME
from istio_agent.cni.install import add_server
from istio_agent.cni.install.add_server import AddServer, InvocationError, parse_invocation, same_netns
from tests.cni.fake_kube import TOKEN, FakeKube, sidecar_pod, start_fake_kube
from tests.cni.install.layout import Node as InstallNode
from tests.cni.install.layout import start_install_cni
from tests.cni.netns import Netns, needs_root, netns
from tests.cni.test_plugin_exec import AGENT_POD_ARGS, PLUGIN, Run
from tests.cni.test_plugin_exec import Node as PluginNode
from tests.cni.test_plugin_exec import node as plugin_node  # noqa: F401  (a fixture: the plugin's view of a node)
from tests.cni.test_plugin_exec import run_plugin as exec_plugin

PREV_RESULT = {"cniVersion": "1.0.0", "ips": [{"address": "10.1.0.5/24"}], "dns": {}}
REDIRECT_LOG = "redirect set up in"


def run_plugin(
    run_dir: Path, pod_netns: Path, name: str = "app-1", namespace: str = "default", **config: Any
) -> Run:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "sandbox1",
        "CNI_NETNS": str(pod_netns),
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
        "CNI_ARGS": f"K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name}",
    }
    stdin = {
        "cniVersion": "1.0.0",
        "name": "k8s-pod-network",
        "type": "istio-cni",
        "cni_agent_run_dir": str(run_dir),
        "pod_namespace": "istio-system",
        "prevResult": PREV_RESULT,
        **config,
    }
    start = time.monotonic()
    done = subprocess.run(
        [str(PLUGIN)],
        input=json.dumps(stdin),
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return Run(done.returncode, done.stdout, done.stderr, time.monotonic() - start)


def nat_rules(space: Netns) -> str:
    out = ""
    for save in ("iptables-nft-save", "iptables-legacy-save"):
        out += subprocess.run(
            ["ip", "netns", "exec", space.name, save, "-t", "nat"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
    return out


class InstallCni:
    """The install-cni process; its output is collected by a thread (read it with :meth:`log`)."""

    def __init__(self, node: InstallNode, kube: FakeKube) -> None:
        self.process = start_install_cni(node, kube.port, kube.ca_pem, TOKEN, subprocess.PIPE)
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.append(line.decode(errors="replace"))

    def log(self) -> str:
        return "".join(self._lines)

    async def serving(self, socket_path: Path) -> None:
        deadline = time.monotonic() + 20
        while "serving the plugin's ADD" not in self.log() or not socket_path.exists():
            assert self.process.poll() is None, f"install-cni exited: {self.log()}"
            assert time.monotonic() < deadline, f"install-cni never served the ADD: {self.log()}"
            await asyncio.sleep(0.02)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._reader.join(timeout=5)


@pytest.fixture
async def kube(tmp_path: Path) -> AsyncIterator[FakeKube]:
    state = tmp_path / "ca"
    state.mkdir()
    fake, runner = await start_fake_kube(state)
    fake.add_pod(sidecar_pod())
    try:
        yield fake
    finally:
        await runner.cleanup()


@pytest.fixture
def pod() -> Iterator[Netns]:
    with netns("handoff") as space:
        yield space


@needs_root
@pytest.mark.e2e
async def test_install_cni_runs_the_add_and_a_killed_one_leaves_it_to_the_plugin(
    tmp_path: Path, kube: FakeKube, pod: Netns
) -> None:
    (tmp_path / "node").mkdir()
    node = InstallNode(tmp_path / "node")
    node.put("calico.conflist", "10-calico.conflist")
    agent = InstallCni(node, kube)
    try:
        sock = node.run / SOCKET_NAME
        await agent.serving(sock)
        assert sock.stat().st_mode & 0o777 == 0o600
        handed = await asyncio.to_thread(run_plugin, node.run, pod.path)
        assert handed.code == 0, (handed.stdout, handed.stderr, agent.log())
        assert handed.json == PREV_RESULT
        assert "ISTIO_OUTPUT" in nat_rules(pod)
        assert REDIRECT_LOG in agent.log() and REDIRECT_LOG not in handed.stderr
        # SIGKILL: no cleanup, the socket file stays and nobody listens on it.
        agent.process.send_signal(signal.SIGKILL)
        agent.stop()
        assert sock.exists()
        with netns("handoff2") as second:
            alone = await asyncio.to_thread(run_plugin, node.run, second.path)
            assert alone.code == 0, (alone.stdout, alone.stderr)
            assert REDIRECT_LOG in alone.stderr
            assert "ISTIO_OUTPUT" in nat_rules(second)
    finally:
        agent.stop()


@contextmanager
def hung_agent(run_dir: Path) -> Iterator[Path]:
    """A FAKE node agent: a socket in ``run_dir`` that takes connections and never answers."""
    run_dir.mkdir()
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hung.bind(str(run_dir / SOCKET_NAME))
    hung.listen(1)
    with hung:
        yield run_dir


@needs_root
async def test_a_node_agent_that_never_answers_is_an_error_within_the_deadline(
    tmp_path: Path, pod: Netns
) -> None:
    with hung_agent(tmp_path / "run") as run_dir:
        result = await asyncio.to_thread(run_plugin, run_dir, pod.path, add_timeout="1s")
    assert result.code == 1
    assert result.json["code"] == 999
    assert "did not answer within the ADD deadline of 1s" in result.json["msg"]
    assert 1.0 <= result.seconds < 3.0
    assert "ISTIO_OUTPUT" not in nat_rules(pod)


def test_an_add_timeout_the_hand_over_does_not_read_runs_the_add_in_process(
    tmp_path: Path, pod_file: Path
) -> None:
    """A number of seconds is not a Go duration: the hand-over leaves it to the plugin's config
    reader (which takes it): no connection."""
    with hung_agent(tmp_path / "run") as run_dir:
        result = run_plugin(
            run_dir, pod_file, name="istio-cni-node-x", namespace="istio-system", add_timeout=2
        )
    # The node agent's own pod needs nothing (Istio's first check), so the in-process ADD succeeds.
    assert result.code == 0, result.stdout


@pytest.fixture
def pod_file(tmp_path: Path) -> Path:
    path = tmp_path / "netns"
    path.touch()
    return path


@contextmanager
def answering_agent(run_dir: Path, answer: bytes) -> Iterator[Path]:
    """A FAKE node agent: it reads the plugin's whole message, answers ``answer`` and closes."""
    run_dir.mkdir()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(run_dir / SOCKET_NAME))
    server.listen(1)

    def serve() -> None:
        connection, _ = server.accept()
        with connection:
            while connection.recv(65536):
                pass
            connection.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with server:
        yield run_dir
        thread.join(timeout=10)


@pytest.mark.parametrize(
    ("answer", "code", "stdout"),
    [
        (b'{"exit": 1, "stdout": "{\\"code\\": 7}"}', 1, {"code": 7}),  # printed as given
        (
            b'{"fallback": "not the same netns"}',
            0,
            {"cniVersion": "1.0.0", "ips": [{"address": "10.1.0.5/24"}], "dns": {}},
        ),
        (b"garbage", 1, "closed the connection without an answer"),
        (b'{"exit": "0"}', 1, "answered without exit and stdout"),
    ],
)
def test_the_plugin_prints_the_node_agents_answer_falls_back_or_fails_closed(
    tmp_path: Path, pod_file: Path, answer: bytes, code: int, stdout: Any
) -> None:
    # The node agent's own pod: an in-process ADD (the fallback) succeeds without an API server.
    with answering_agent(tmp_path / "run", answer) as run_dir:
        result = run_plugin(run_dir, pod_file, name="istio-cni-node-x", namespace="istio-system")
    assert result.code == code, result.stdout
    if isinstance(stdout, str):
        assert result.json["code"] == 999 and stdout in result.json["msg"]
    else:
        assert result.json == stdout


@pytest.mark.parametrize("timeout", ["1m30s", "2562047h47m16.854775807s"])
def test_any_add_timeout_go_reads_is_handed_over(tmp_path: Path, pod_file: Path, timeout: str) -> None:
    """Read as Go reads it (the in-process ADD's reader), up to Go's longest duration."""
    answer = b'{"exit": 0, "stdout": "handed over"}'
    with answering_agent(tmp_path / "run", answer) as run_dir:
        result = run_plugin(run_dir, pod_file, add_timeout=timeout)
    assert (result.code, result.stdout) == (0, "handed over"), result.stderr


FAKE_AGENT = """
import socket, sys
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(sys.argv[1])
server.listen(1)
print("listening", flush=True)
connection, _ = server.accept()
connection.settimeout(10)
received = b""
try:
    while chunk := connection.recv(65536):
        received += chunk
    connection.sendall(b'{"exit": 0, "stdout": "no rules, but success"}')
except OSError:
    pass
print(len(received), flush=True)
"""
"""A FAKE node agent for another user to run: it answers success to whoever connects, and says how
many bytes it was sent."""


@contextmanager
def agent_of_another_user(uid: int) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """A world-writable run dir (no install-cni there) whose ``plugin-add.sock`` ``uid`` bound."""
    import shutil
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="handoff-squat-"))
    try:
        top.chmod(0o755)
        run_dir = top / "run"
        run_dir.mkdir()
        run_dir.chmod(0o1777)
        agent = subprocess.Popen(
            ["/usr/bin/python3", "-c", FAKE_AGENT, str(run_dir / SOCKET_NAME)],
            user=uid,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert agent.stdout is not None and agent.stdout.readline() == "listening\n"
            yield run_dir, agent
        finally:
            agent.kill()
            agent.wait()
    finally:
        shutil.rmtree(top)


@needs_root
def test_a_socket_another_user_serves_is_not_trusted(pod_file: Path) -> None:
    """The plugin runs as root: a socket in the run dir served by anyone but root (or the plugin's
    own user) gets neither the invocation nor the say on the result; the plugin runs the ADD."""
    with agent_of_another_user(65534) as (run_dir, agent):
        result = run_plugin(run_dir, pod_file, name="istio-cni-node-x", namespace="istio-system")
        agent.kill()
        told, _ = agent.communicate(timeout=10)
    assert result.stdout != "no rules, but success"
    assert result.code == 0, result.stdout + result.stderr
    assert result.json == PREV_RESULT  # the in-process ADD's result
    assert "node agent itself" in result.stderr
    assert "served by uid 65534" in result.stderr
    assert told.strip() in ("", "0")  # not even the invocation was sent


@needs_root
def test_a_socket_the_plugins_own_user_serves_is_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin run as another user (not on a node; tests) hands over to that user's node agent:
    a process of its own user could take it over anyway."""
    monkeypatch.setattr(handoff.os, "geteuid", lambda: 65534)
    with agent_of_another_user(65534) as (run_dir, _agent):
        assert hand_over_add(run_dir) == (0, "no rules, but success")


# -- the server's checks, without processes ------------------------------------------------------------


def test_the_node_agent_declines_a_namespace_it_sees_differently(tmp_path: Path) -> None:
    here = tmp_path / "ns"
    here.touch()
    info = os.stat(here)
    assert same_netns(str(here), [info.st_dev, info.st_ino])
    assert not same_netns(str(here), [info.st_dev, info.st_ino + 1])
    assert not same_netns(str(here), None)  # the plugin did not see it, the node agent does
    assert not same_netns(str(tmp_path / "gone"), [info.st_dev, info.st_ino])
    assert same_netns(str(tmp_path / "gone"), None)  # neither sees it: the ADD reports it


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (b"not json", "not JSON"),
        (b"[]", "not a JSON object"),
        (b'{"env": {"A": 1}, "stdin": "", "elapsed": 0}', "env is not an object of strings"),
        (b'{"env": {}, "stdin": 3, "elapsed": 0}', "stdin is not a string"),
        (b'{"env": {}, "stdin": "", "elapsed": -1}', "elapsed"),
        (b'{"env": {}, "stdin": "", "elapsed": 0, "netns": [1]}', "netns"),
    ],
)
def test_a_bad_hand_over_message_is_refused_with_the_reason(message: bytes, error: str) -> None:
    with pytest.raises(InvocationError, match=error):
        parse_invocation(message)


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"cni_agent_run_dir": "/run/" + "x" * 120}, "too long for a unix socket"),
        (
            {"cni_agent_run_dir": "/nonexistent-run-dir"},
            "no node agent on /nonexistent-run-dir/plugin-add.sock",
        ),
        ({"cni_agent_run_dir": "/r", "add_timeout": "1e12s"}, "add_timeout that is not a Go duration"),
        ({"cni_agent_run_dir": "/r", "add_timeout": "0.5ms"}, "add_timeout that is not a Go duration"),
        ({"add_timeout": "30s"}, "no cni_agent_run_dir"),
    ],
)
def test_what_the_plugin_runs_itself(config: dict[str, Any], reason: str) -> None:
    with pytest.raises(handoff.Fallback, match=reason):
        handoff.hand_over({"CNI_COMMAND": "ADD"}, json.dumps(config).encode(), time.monotonic())


# -- the server in this process: its bound, its answers, its socket ------------------------------------


async def until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)


@pytest.mark.e2e
async def test_when_every_add_worker_is_stuck_the_next_add_runs_in_the_plugin_at_once(
    plugin_node: PluginNode,  # noqa: F811  (the fixture imported above)
    tmp_path: Path,
) -> None:
    node, kube = plugin_node, plugin_node.kube
    kube.add_pod(sidecar_pod())
    kube.failures.extend(["hang", "hang"])  # the FAKE API server hangs for the first two pods
    server = AddServer(node.run_dir, max_adds=2)
    await server.start()
    try:
        stuck = [
            asyncio.create_task(
                exec_plugin(
                    node.env(DRY_RUN_FILE_PATH=str(tmp_path / f"stuck{i}.txt")), node.config(add_timeout="3s")
                )
            )
            for i in range(2)
        ]
        await until(lambda: len(kube.requests) == 2, "both ADDs asked the API server")
        third = await exec_plugin(node.env(), node.config(add_timeout="3s"))
        assert not any(task.done() for task in stuck), "the third ADD waited for the stuck ones"
        assert third.code == 0, third.stdout + third.stderr
        assert REDIRECT_LOG in third.stderr  # the plugin ran it in its own process
        assert node.dry_run.exists()
        for run in await asyncio.gather(*stuck):
            # The server's "no answer from the API server" and the plugin's "the node agent did not
            # answer" race at the same deadline; either way it is an error result.
            assert run.code == 1 and run.json["code"] == 999, run.stdout
            assert REDIRECT_LOG not in run.stderr  # these were handed over
    finally:
        await server.stop()
    assert not server.path.exists()


@pytest.mark.e2e
async def test_a_config_too_large_to_hand_over_runs_in_the_plugin(
    plugin_node: PluginNode,  # noqa: F811  (the fixture imported above)
) -> None:
    """Over the node agent's message limit, the ADD runs as it would without a node agent (and
    succeeds as it does there), rather than failing on a connection the node agent cut."""
    node = plugin_node
    node.kube.add_pod(sidecar_pod())
    server = AddServer(node.run_dir)
    await server.start()
    try:
        run = await exec_plugin(node.env(), node.config(padding="x" * add_server.MAX_MESSAGE))
    finally:
        await server.stop()
    assert run.code == 0, run.stdout + run.stderr
    assert REDIRECT_LOG in run.stderr  # the plugin ran it in its own process
    assert "too large to hand over" in run.stderr
    assert node.dry_run.exists()


async def test_a_config_small_enough_to_hand_over_gets_its_whole_result_back(
    plugin_node: PluginNode,  # noqa: F811  (the fixture imported above)
) -> None:
    """The result is printed indented and with ``<`` escaped as ``\\u003c``: several times the
    config's size, and still answered (the plugin reads what any handed-over config can give)."""
    node = plugin_node
    previous = {**PREV_RESULT, "dns": {"domain": "<" * (add_server.MAX_MESSAGE - 4096)}}
    server = AddServer(node.run_dir)
    await server.start()
    try:
        run = await exec_plugin(node.env(CNI_ARGS=AGENT_POD_ARGS), node.config(prevResult=previous))
    finally:
        await server.stop()
    assert run.code == 0, run.stdout[:300] + run.stderr
    assert run.json == previous
    assert "running the ADD in the plugin" not in run.stderr  # handed over


def hand_over_add(run_dir: Path) -> tuple[int, str]:
    config = {"cniVersion": "1.0.0", "name": "net", "type": "istio-cni", "cni_agent_run_dir": str(run_dir)}
    env = {"CNI_COMMAND": "ADD", "CNI_NETNS": "/nonexistent-netns"}
    return handoff.hand_over(env, json.dumps(config).encode(), time.monotonic())


async def test_an_add_that_raises_is_answered_with_the_error_not_a_closed_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> tuple[int, str]:
        raise ValueError("a bug in the ADD")

    monkeypatch.setattr(add_server, "run_add", broken)
    server = AddServer(tmp_path / "run")
    await server.start()
    try:
        code, stdout = await asyncio.to_thread(hand_over_add, tmp_path / "run")
    finally:
        await server.stop()
    assert code == 1
    assert json.loads(stdout) == {"code": 999, "msg": "the node agent's ADD failed: a bug in the ADD"}


def exchange(path: Path, message: bytes) -> bytes:
    """Send ``message`` as the plugin does (all of it, then shut down) and read the answer to EOF."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(20)
        client.connect(str(path))
        client.sendall(message)
        client.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    return answer


async def ask_node_agent(run_dir: Path, message: bytes) -> Any:
    """One raw hand-over message to a real node agent's ADD server on ``run_dir``; its JSON answer."""
    server = AddServer(run_dir)
    await server.start()
    try:
        return json.loads(await asyncio.to_thread(exchange, server.path, message))
    finally:
        await server.stop()


DEEP = "[" * 100_000 + "]" * 100_000
ADD_ENV = {
    "CNI_COMMAND": "ADD",
    **{k: "x" for k in ("CNI_CONTAINERID", "CNI_IFNAME", "CNI_NETNS", "CNI_PATH")},
}


@pytest.mark.parametrize(
    ("message", "code", "msg"),
    [
        (DEEP.encode(), 999, "the hand-over message is nested too deeply"),
        (
            json.dumps({"env": ADD_ENV, "stdin": DEEP, "elapsed": 0, "netns": None}).encode(),
            6,
            "error unmarshall network config: nested too deeply",
        ),
    ],
    ids=["message", "config"],
)
async def test_the_node_agent_answers_deeply_nested_json_with_an_error_not_a_traceback(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    message: bytes,
    code: int,
    msg: str,
) -> None:
    answer = await ask_node_agent(tmp_path / "run", message)
    assert answer["exit"] == 1
    result = json.loads(answer["stdout"])
    assert result["code"] == code and msg in result["msg"], result
    assert not [record for record in caplog.records if record.exc_info], caplog.text
    assert "Traceback" not in capsys.readouterr().err


async def test_the_node_agent_declines_a_netns_path_no_namespace_can_have(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A NUL byte: no path, so not the namespace the plugin saw (and no traceback for it)."""
    message = {
        "env": {**ADD_ENV, "CNI_NETNS": "/run/netns/a\0b"},
        "stdin": "{}",
        "elapsed": 0,
        "netns": [1, 2],
    }
    answer = await ask_node_agent(tmp_path / "run", json.dumps(message).encode())
    assert "does not see" in answer["fallback"]
    assert not [record for record in caplog.records if record.exc_info], caplog.text


async def test_a_request_the_node_agent_did_not_foresee_is_answered_with_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any) -> bool:
        raise ValueError("a bug in the checks")

    monkeypatch.setattr(add_server, "same_netns", broken)
    message = {"env": ADD_ENV, "stdin": "{}", "elapsed": 0, "netns": None}
    answer = await ask_node_agent(tmp_path / "run", json.dumps(message).encode())
    assert answer["exit"] == 1
    assert json.loads(answer["stdout"]) == {
        "code": 999,
        "msg": "the node agent cannot serve the request: a bug in the checks",
    }
    assert "cannot serve the request: a bug in the checks" in caplog.text
    assert not [record for record in caplog.records if record.exc_info], caplog.text


async def test_the_socket_is_owner_only_from_the_moment_it_is_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    modes: list[int] = []
    real_start = asyncio.start_unix_server

    async def start_and_look(*args: Any, **kwargs: Any) -> asyncio.AbstractServer:
        server = await real_start(*args, **kwargs)
        modes.append(os.stat(kwargs["path"]).st_mode & 0o777)  # before start() gets to chmod
        return server

    monkeypatch.setattr(add_server.asyncio, "start_unix_server", start_and_look)
    umask = os.umask(0o022)
    try:
        server = AddServer(tmp_path / "run")
        await server.start()
        assert os.umask(0o022) == 0o022  # the process's umask is back
    finally:
        os.umask(umask)
    try:
        assert modes and modes[0] & 0o077 == 0, oct(modes[0])
        assert server.path.stat().st_mode & 0o777 == 0o600
    finally:
        await server.stop()


@needs_root
async def test_a_peer_that_is_not_root_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import shutil
    import tempfile

    # A directory "nobody" can reach, and the socket opened up, as if its mode had been weakened:
    # the peer check is what still stands between another user and the ADD's environment.
    top = Path(tempfile.mkdtemp(prefix="handoff-peer-"))
    try:
        top.chmod(0o755)
        server = AddServer(top / "run")
        await server.start()
        (top / "run").chmod(0o755)
        server.path.chmod(0o666)
        client = (
            "import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "s.connect(sys.argv[1])\n"
            "try:\n"
            "    s.sendall(b'{}')\n"
            "    s.shutdown(socket.SHUT_WR)\n"
            "    sys.stdout.write(repr(s.recv(65536)))\n"
            "except (BrokenPipeError, ConnectionResetError):\n"  # the server may close before we send
            "    sys.stdout.write('reset')\n"
        )
        try:
            done = await asyncio.to_thread(
                subprocess.run,
                ["/usr/bin/python3", "-c", client, str(server.path)],
                user=65534,
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
            )
        finally:
            await server.stop()
    finally:
        shutil.rmtree(top)
    assert done.returncode == 0, done.stderr
    assert done.stdout in ("b''", "reset")  # no answer at all: not even an error about the message
    assert "refused a connection from uid 65534" in caplog.text


async def test_start_replaces_only_a_stale_socket(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = run_dir / SOCKET_NAME
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(str(path))  # bound, nobody listening: what a killed install-cni leaves
    server = AddServer(run_dir)
    await server.start()
    try:
        assert await asyncio.to_thread(hand_over_add, run_dir) != ()  # ours now: it answers
        with pytest.raises(OSError, match="another process serves the ADD hand-over on"):
            await AddServer(run_dir).start()
        assert path.exists()
    finally:
        await server.stop()
    path.write_text("not a socket")
    with pytest.raises(OSError, match="exists and is not a socket"):
        await AddServer(run_dir).start()
    assert path.read_text() == "not a socket"


async def test_stop_leaves_a_socket_that_replaced_ours(tmp_path: Path) -> None:
    server = AddServer(tmp_path / "run")
    await server.start()
    server.path.unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as successor:
        successor.bind(str(server.path))  # another install-cni's
        await server.stop()
        assert server.path.exists()


def test_a_socket_the_plugin_cannot_open_is_an_error_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_descriptors(*args: Any) -> socket.socket:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(handoff.socket, "socket", no_descriptors)
    code, stdout = hand_over_add(tmp_path)
    assert code == 1
    assert json.loads(stdout) == {
        "code": 999,
        "msg": "cannot open a socket to the node agent: Too many open files",
    }
