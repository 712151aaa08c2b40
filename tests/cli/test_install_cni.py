"""``install-cni`` as a process: Istio's flags and env in, ready on /readyz, SIGTERM cleans up and exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from click.testing import CliRunner

from istio_agent.cli.install_cni import _plugin_log_level, main
from istio_agent.cni.install import conffiles
from tests.cni.install.layout import TOKEN, Node, install_cni_args

INSTALL_CNI = Path(sys.executable).parent / "install-cni"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_runs_is_ready_and_cleans_up_on_sigterm(tmp_path: Path) -> None:
    node = Node(tmp_path)
    calico = node.put("calico.conflist", "10-calico.conflist")
    before = calico.read_bytes()
    health, monitoring = free_port(), free_port()
    env = {
        **os.environ,
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
        "MOUNTED_CNI_NET_DIR": str(node.conf),  # env and flags mixed, as a DaemonSet does
        "EXCLUDE_NAMESPACES": "kube-system",
    }
    args = [
        str(INSTALL_CNI),
        f"--cni-agent-run-dir={node.run}",
        f"--cni-bin-source-dir={node.source}",
        f"--cni-bin-target-dirs={node.bin}",
        f"--service-account-dir={node.sa}",
        f"--health-port={health}",
        f"--monitoring-port={monitoring}",
        "--log_output_level=default:info,cni-plugin:debug",
    ]
    process = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 20
            while True:
                try:
                    async with session.get(f"http://127.0.0.1:{health}/readyz") as response:
                        if response.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                assert process.poll() is None, "install-cni exited"
                assert time.monotonic() < deadline, "install-cni never became ready"
                await asyncio.sleep(0.02)
            async with session.get(f"http://127.0.0.1:{monitoring}/metrics") as response:
                assert "istio_cni_install_ready 1" in await response.text()
        document = conffiles.read_document(calico)
        ours = document["plugins"][-1]
        assert ours["type"] == "istio-cni" and ours["plugin_log_level"] == "debug"
        assert ours["exclude_namespaces"] == ["kube-system"]
        assert (node.bin / "istio-cni").exists()
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    log = output.decode()
    assert process.returncode == 0, log
    assert conffiles.parse(calico.read_bytes()) == conffiles.parse(before)
    assert not (node.bin / "istio-cni").exists()
    assert not (node.run / "istio-cni-kubeconfig").exists()
    assert "\tinfo\tcni-agent\tCopied istio-cni to " in log and '"token": "<redacted>"' in log
    assert TOKEN not in log


def test_a_bad_value_is_a_clear_error_and_exit_1() -> None:
    result = CliRunner().invoke(main, ["--chained-cni-plugin=maybe"], env={})
    assert result.exit_code == 1
    assert "invalid value for --chained-cni-plugin='maybe'" in result.output


def test_a_bad_log_level_is_a_clear_error_and_exit_1() -> None:
    result = CliRunner().invoke(main, ["--log_output_level=default:loud"], env={})
    assert result.exit_code == 1
    assert "invalid log level 'loud'" in result.output


def test_the_plugin_log_level_is_the_cni_plugin_scopes() -> None:
    assert _plugin_log_level("default:info") == "info"
    assert _plugin_log_level("default:debug,cni-plugin:warn") == "warn"
    assert _plugin_log_level("cni-plugin:none") == "none"


def launch(node: Node, health: int) -> subprocess.Popen[bytes]:
    """install-cni on ``node`` with ``/readyz`` on ``health`` and no metrics listener."""
    env = {**os.environ, "KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    args = install_cni_args(node, health_port=health)
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


async def readyz(health: int) -> int | None:
    """``/readyz``'s status, or None when it does not answer within a second (refused or hung)."""
    try:
        timeout = aiohttp.ClientTimeout(total=1.0)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(f"http://127.0.0.1:{health}/readyz") as response,
        ):
            return response.status
    except (aiohttp.ClientError, TimeoutError):
        return None


async def wait_ready(process: subprocess.Popen[bytes], health: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while await readyz(health) != 200:
        assert process.poll() is None, "install-cni exited"
        assert time.monotonic() < deadline, "install-cni never became ready"
        await asyncio.sleep(0.02)


def stop(process: subprocess.Popen[bytes]) -> tuple[int, str]:
    """SIGTERM, then the exit status and output (SIGKILL and a failure when it does not end)."""
    process.send_signal(signal.SIGTERM)
    try:
        output, _ = process.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        raise AssertionError(f"install-cni ignored SIGTERM:\n{output.decode()}") from None
    return process.returncode, output.decode()


async def test_a_second_instance_leaves_the_first_ones_files_alone(tmp_path: Path) -> None:
    node = Node(tmp_path)
    calico = node.put("calico.conflist", "10-calico.conflist")
    first_port = free_port()
    first = launch(node, first_port)
    try:
        await wait_ready(first, first_port)
        installed = {p: p.read_bytes() for p in (node.bin / "istio-cni", node.run / "istio-cni-kubeconfig")}
        installed[calico] = calico.read_bytes()
        second = launch(node, free_port())
        output, _ = second.communicate(timeout=20)
        assert second.returncode == 1, output.decode()
        assert "another install-cni is running on this node" in output.decode()
        for path, data in installed.items():
            assert path.exists() and path.read_bytes() == data, f"the second instance changed {path}"
        assert await readyz(first_port) == 200
    finally:
        code, log = stop(first)
    assert code == 0, log
    assert not (node.bin / "istio-cni").exists()


async def test_a_fifo_in_the_config_dir_is_skipped_not_waited_on(tmp_path: Path) -> None:
    """open() of a FIFO blocks until a writer comes: install-cni must neither hang nor ignore SIGTERM."""
    node = Node(tmp_path)
    calico = node.put("calico.conflist", "10-calico.conflist")
    before = calico.read_bytes()
    os.mkfifo(node.conf / "00-fifo.conflist")
    health = free_port()
    process = launch(node, health)
    try:
        await wait_ready(process, health, timeout=10)
        assert "istio-cni" in calico.read_text()
    finally:
        code, log = stop(process)
    assert code == 0, log
    assert "00-fifo.conflist" in log and "not a regular file" in log, log
    assert conffiles.parse(calico.read_bytes()) == conffiles.parse(before)
    assert not (node.bin / "istio-cni").exists()
