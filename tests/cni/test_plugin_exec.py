"""The real ``istio-cni`` executable, exec'd as a container runtime execs it (env + stdin -> stdout).

The pod objects come from a FAKE Kubernetes API server (``fake_kube.py``: HTTPS on loopback), since
no real one runs here. The dry-run cases are Istio's ``cni/pkg/plugin/plugin_dryrun_test.go``: the
rules the plugin would program for a pod, written to ``DRY_RUN_FILE_PATH``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.cni.fake_kube import TOKEN, FakeKube, sidecar_pod, start_fake_kube
from tests.cni.netns import needs_root, netns

GOLDEN = Path(__file__).parent / "golden"
PLUGIN = Path(sys.executable).parent / "istio-cni"
POD_ARGS = "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=app-1;K8S_POD_INFRA_CONTAINER_ID=abc"
PREV_RESULT = {
    "cniVersion": "1.0.0",
    "interfaces": [{"name": "eth0", "mac": "aa:bb:cc:dd:ee:ff", "sandbox": "/var/run/netns/x"}],
    "ips": [{"interface": 0, "address": "10.1.0.5/24", "gateway": "10.1.0.1"}],
    "routes": [{"dst": "0.0.0.0/0", "gw": "10.1.0.1"}],
    "dns": {},
}


@dataclasses.dataclass
class Run:
    code: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def json(self) -> Any:
        return json.loads(self.stdout)


@dataclasses.dataclass
class Node:
    """A node's view for the plugin: its run dir (kubeconfig), a netns stand-in, the fake API."""

    kube: FakeKube
    run_dir: Path
    netns: Path
    dry_run: Path

    def config(self, **extra: Any) -> dict[str, Any]:
        return {
            "cniVersion": "1.0.0",
            "name": "k8s-pod-network",
            "type": "istio-cni",
            "cni_agent_run_dir": str(self.run_dir),
            "pod_namespace": "istio-system",
            "exclude_namespaces": ["istio-system"],
            "prevResult": PREV_RESULT,
            **extra,
        }

    def env(self, **extra: str) -> dict[str, str]:
        return {
            "CNI_COMMAND": "ADD",
            "CNI_CONTAINERID": "abc123",
            "CNI_NETNS": str(self.netns),
            "CNI_IFNAME": "eth0",
            "CNI_PATH": "/opt/cni/bin",
            "CNI_ARGS": POD_ARGS,
            "DRY_RUN_FILE_PATH": str(self.dry_run),
            **extra,
        }


async def run_plugin(env: dict[str, str], stdin: bytes | str | dict[str, Any] = b"") -> Run:
    data = json.dumps(stdin).encode() if isinstance(stdin, dict) else stdin
    data = data.encode() if isinstance(data, str) else data
    full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}
    start = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        str(PLUGIN),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=full_env,
    )
    out, err = await process.communicate(data)
    assert process.returncode is not None
    return Run(process.returncode, out.decode(), err.decode(), time.monotonic() - start)


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    state = tmp_path / "ca"
    state.mkdir()
    kube, runner = await start_fake_kube(state)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "istio-cni-kubeconfig").write_text(kube.kubeconfig())
    netns = tmp_path / "netns"
    netns.touch()  # the dry run never enters it; it must only exist
    try:
        yield Node(kube, run_dir, netns, tmp_path / "rules.txt")
    finally:
        await runner.cleanup()


def test_plugin_executable_is_installed() -> None:
    assert PLUGIN.exists(), f"{PLUGIN} missing: reinstall the package (pip install -e .)"


# -- the contract -----------------------------------------------------------------------------------


async def test_version_ignores_stdin() -> None:
    run = await run_plugin({"CNI_COMMAND": "VERSION"}, b"not json at all")
    assert run.code == 0
    assert run.stdout == (
        '{"cniVersion":"1.1.0","supportedVersions":["0.1.0","0.2.0","0.3.0","0.3.1","0.4.0","1.0.0","1.1.0"]}\n'
    )


async def test_no_command_says_what_it_is() -> None:
    run = await run_plugin({})
    assert run.code == 0 and run.stdout == ""
    assert run.stderr.startswith("CNI plugin istio-cni ")
    assert "CNI protocol versions supported: 0.1.0, 0.2.0, 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0" in run.stderr


async def test_missing_env_is_code_4(node: Node) -> None:
    env = node.env()
    del env["CNI_NETNS"], env["CNI_IFNAME"]
    run = await run_plugin(env, node.config())
    assert run.code == 1
    assert run.json == {"code": 4, "msg": "required env variables [CNI_NETNS,CNI_IFNAME] missing"}
    assert run.stdout.startswith('{\n    "code": 4,\n    "msg": ')  # 4-space indent, as the library prints


async def test_malformed_stdin_is_code_6(node: Node) -> None:
    run = await run_plugin(node.env(), b'{"name": "x", ')
    assert run.code == 1
    assert run.json["code"] == 6
    assert run.json["msg"].startswith("error unmarshall network config")


AGENT_POD_ARGS = "K8S_POD_NAMESPACE=istio-system;K8S_POD_NAME=istio-cni-node-x7f2q"
"""The node agent's own pod: the ADD succeeds without asking the API server."""


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [sys.getrecursionlimit() - 20, sys.getrecursionlimit() - 5, 100_000])
@pytest.mark.parametrize("where", ["key", "prevResult"])
async def test_deeply_nested_stdin_is_an_error_result_not_a_traceback(
    node: Node, where: str, depth: int
) -> None:
    """Nesting Python's decoder cannot follow (its recursion limit) is a decoding error, code 6, as
    any other stdin that is not a config; near the limit it may be read as usual."""
    config = json.dumps({k: v for k, v in node.config().items() if k != "prevResult"})
    extra = f'"x": {nested(depth)}' if where == "key" else f'"prevResult": {{"ips": {nested(depth)}}}'
    run = await run_plugin(node.env(CNI_ARGS=AGENT_POD_ARGS), config[:-1] + ", " + extra + "}")
    assert "Traceback" not in run.stderr, run.stderr
    decoding_error = {"code": 6, "msg": "error unmarshall network config: nested too deeply"}
    if depth >= sys.getrecursionlimit():
        assert (run.code, run.json) == (1, decoding_error)
    elif run.code == 0:
        assert where == "key" and run.json == {"cniVersion": "1.0.0", "dns": {}}
    else:  # read, and refused for what it is; or just too deep for the stack it was read on
        refused = "prevResult.ips[0]: expected an object, got list" in run.json["msg"]
        assert run.json == decoding_error or (where == "prevResult" and refused), run.json


@pytest.mark.parametrize(
    ("timeout", "problem"),
    [
        ("1e12s", 'time: unknown unit "e" in duration "1e12s"'),  # a float, not a Go duration
        ("9223372036.854775808s", 'time: invalid duration "9223372036.854775808s"'),  # 1ns past Go's range
        ("2562048h", 'time: invalid duration "2562048h"'),
        ("inf", 'time: invalid duration "inf"'),
    ],
)
async def test_an_add_timeout_go_refuses_is_an_error_result(node: Node, timeout: str, problem: str) -> None:
    run = await run_plugin(node.env(CNI_ARGS=AGENT_POD_ARGS), node.config(add_timeout=timeout))
    assert "Traceback" not in run.stderr, run.stderr
    assert run.code == 1
    assert run.json == {"code": 999, "msg": f"invalid network config: add_timeout: {problem}"}


async def test_the_longest_add_timeout_go_reads_is_read(node: Node) -> None:
    longest = "2562047h47m16.854775807s"  # Go's largest time.Duration
    run = await run_plugin(node.env(CNI_ARGS=AGENT_POD_ARGS), node.config(add_timeout=longest))
    assert run.code == 0, run.stdout + run.stderr
    assert run.json["ips"] == PREV_RESULT["ips"]


async def test_incompatible_version_is_code_1(node: Node) -> None:
    run = await run_plugin(node.env(), node.config(cniVersion="2.0.0"))
    assert (run.code, run.json["code"], run.json["msg"]) == (1, 1, "incompatible CNI versions")


async def test_check_and_del_succeed_silently(node: Node) -> None:
    for command in ("CHECK", "DEL"):
        run = await run_plugin(node.env(CNI_COMMAND=command), node.config())
        assert (run.code, run.stdout) == (0, ""), run.stdout
    assert node.kube.requests == []


async def test_add_passes_prev_result_through(node: Node) -> None:
    node.kube.add_pod(sidecar_pod())
    run = await run_plugin(node.env(), node.config(cniVersion="0.4.0", prevResult=PREV_RESULT))
    assert run.code == 0, run.stdout + run.stderr
    assert run.json == {
        "cniVersion": "0.4.0",
        "interfaces": [{"name": "eth0", "mac": "aa:bb:cc:dd:ee:ff", "sandbox": "/var/run/netns/x"}],
        "ips": [{"version": "4", "interface": 0, "address": "10.1.0.5/24", "gateway": "10.1.0.1"}],
        "routes": [{"dst": "0.0.0.0/0", "gw": "10.1.0.1"}],
        "dns": {},
    }
    assert node.dry_run.exists()


async def test_logs_are_json_on_stderr_without_the_token(node: Node) -> None:
    node.kube.add_pod(sidecar_pod())
    run = await run_plugin(node.env(), node.config(plugin_log_level="debug"))
    assert run.code == 0, run.stderr
    lines = [json.loads(line) for line in run.stderr.splitlines()]
    assert lines and all({"time", "level", "scope", "msg"} <= set(line) for line in lines)
    assert any("redirect set up" in line["msg"] for line in lines)
    assert TOKEN not in run.stderr and TOKEN not in run.stdout


# -- the dry-run cases ------------------------------------------------------------------------------

DRYRUN_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "basic": ({}, "cni-basic"),
    "include-exclude-ip": (
        {
            "annotations": {
                "traffic.sidecar.istio.io/includeOutboundIPRanges": "127.0.0.0/8",
                "traffic.sidecar.istio.io/excludeOutboundIPRanges": "10.0.0.0/8",
            }
        },
        "cni-include-exclude-ip",
    ),
    "include-exclude-ports": (
        {
            "annotations": {
                "traffic.sidecar.istio.io/includeInboundPorts": "1111,2222",
                "traffic.sidecar.istio.io/excludeInboundPorts": "3333,4444",
                "traffic.sidecar.istio.io/excludeOutboundPorts": "5555,6666",
            }
        },
        "cni-include-exclude-ports",
    ),
    "tproxy": ({"annotations": {"sidecar.istio.io/interceptionMode": "TPROXY"}}, "cni-tproxy"),
    "DNS": ({"proxy_env": {"ISTIO_META_DNS_CAPTURE": "true"}}, "cni-dns"),
    "invalid-drop": ({"proxy_env": {"INVALID_DROP": "true"}}, "cni-invalid-drop"),
    "custom-uid": (
        {"security_context": {"runAsUser": 1000670000, "runAsGroup": 1000670001}},
        "cni-custom-uid",
    ),
    "custom-uid-zero": ({"security_context": {"runAsUser": 0, "runAsGroup": 0}}, "cni-basic"),
    "custom-uid-tproxy": (
        {
            "security_context": {"runAsUser": 1000670000, "runAsGroup": 1000670001},
            "annotations": {"sidecar.istio.io/interceptionMode": "TPROXY"},
        },
        "cni-custom-uid-tproxy",
    ),
}
"""Istio's cases (pod settings, golden): the goldens are ``tests/cni/golden/cni-*.txt``, compared
with Istio's own files in ``test_rules.py``."""


@pytest.mark.parametrize("case", sorted(DRYRUN_CASES))
async def test_dry_run_rules(node: Node, case: str) -> None:
    pod_options, golden = DRYRUN_CASES[case]
    node.kube.add_pod(sidecar_pod(**pod_options))
    run = await run_plugin(node.env(), node.config())
    assert run.code == 0, run.stdout + run.stderr
    assert node.dry_run.read_text() == (GOLDEN / f"{golden}.txt").read_text()


# -- failing closed ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failures", "timeout", "needle"),
    [
        ([500, 500, 500], "1s", "500"),
        ([403], "1s", "403 Forbidden: fake failure 403"),
        (["hang"], "400ms", "no answer from 127.0.0.1"),
    ],
)
async def test_api_failure_is_an_error_result(
    node: Node, failures: list[int | str], timeout: str, needle: str
) -> None:
    node.kube.add_pod(sidecar_pod())
    node.kube.failures.extend(failures)
    run = await run_plugin(node.env(), node.config(add_timeout=timeout))
    assert run.code == 1, run.stdout
    assert run.json["code"] == 999 and needle in run.json["msg"], run.json
    assert run.seconds < 5, "the ADD deadline must bound the whole run"
    assert not node.dry_run.exists()


async def test_unreachable_api_server_is_an_error_result(node: Node, tmp_path: Path) -> None:
    (node.run_dir / "istio-cni-kubeconfig").write_text(node.kube.kubeconfig(server="https://127.0.0.1:1"))
    run = await run_plugin(node.env(), node.config(add_timeout="1s"))
    assert run.code == 1
    assert "cannot connect to 127.0.0.1:1" in run.json["msg"]
    assert not node.dry_run.exists()


async def test_vanished_netns_is_an_error_result(node: Node) -> None:
    node.kube.add_pod(sidecar_pod())
    node.netns.unlink()
    run = await run_plugin(node.env(), node.config())
    assert run.code == 1
    assert "no longer exists" in run.json["msg"]


async def test_missing_kubeconfig_is_an_error_result(node: Node) -> None:
    (node.run_dir / "istio-cni-kubeconfig").unlink()
    run = await run_plugin(node.env(), node.config())
    assert run.code == 1 and "cannot read the kubeconfig" in run.json["msg"]


async def test_agent_pod_needs_no_kubeconfig(node: Node) -> None:
    (node.run_dir / "istio-cni-kubeconfig").unlink()
    args = "K8S_POD_NAMESPACE=istio-system;K8S_POD_NAME=istio-cni-node-x7f2q"
    for ambient in (False, True):
        run = await run_plugin(node.env(CNI_ARGS=args), node.config(ambient_enabled=ambient))
        assert run.code == 0, run.stdout
        assert run.json["ips"] == PREV_RESULT["ips"]


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "asyncio"])
async def test_api_server_certificate_is_verified(node: Node, tmp_path: Path, blocking: bool) -> None:
    from istio_agent.cni.kube import KubeClient, KubeError, read_kubeconfig
    from istio_agent.controlplane.ca import LocalCA

    async def get(path: Path) -> dict[str, Any]:
        client = KubeClient(read_kubeconfig(path))
        deadline = time.monotonic() + 5
        if blocking:  # the plugin's; the fake API server runs on this loop, so on a thread
            return await asyncio.to_thread(client.get_pod_blocking, "default", "app-1", deadline=deadline)
        return await client.get_pod("default", "app-1", deadline=deadline)

    other = tmp_path / "other-ca"
    other.mkdir()
    node.kube.add_pod(sidecar_pod())
    path = node.run_dir / "istio-cni-kubeconfig"
    assert (await get(path))["metadata"]["name"] == "app-1"
    wrong_ca = LocalCA.load_or_create(other, "cluster.local").root_pem
    path.write_text(dataclasses.replace(node.kube, ca_pem=wrong_ca).kubeconfig())
    with pytest.raises(KubeError, match="certificate verify failed"):
        await get(path)
    path.write_text(node.kube.kubeconfig(insecure=True))
    assert (await get(path))["metadata"]["name"] == "app-1"


# -- chained after Debian's bridge plugin, as a runtime chains them ---------------------------------

BRIDGE = Path("/usr/lib/cni/bridge")


async def _new_netns() -> tuple[asyncio.subprocess.Process, Path]:
    """A network namespace held by a sleeping process (no /run/netns mount involved)."""
    holder = await asyncio.create_subprocess_exec("unshare", "--net", "sleep", "60")
    path = Path(f"/proc/{holder.pid}/ns/net")
    for _ in range(200):  # until unshare has exec'd sleep in its new namespace
        if os.stat(path).st_ino != os.stat("/proc/self/ns/net").st_ino:
            return holder, path
        await asyncio.sleep(0.005)
    holder.kill()
    raise AssertionError("unshare --net did not enter a new network namespace")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates network namespaces")
@pytest.mark.skipif(
    not BRIDGE.exists(), reason=f"{BRIDGE} missing: apt-get install containernetworking-plugins"
)
@pytest.mark.parametrize("version", ["1.0.0", "0.4.0"])
async def test_chained_after_the_bridge_plugin(node: Node, tmp_path: Path, version: str) -> None:
    """bridge + host-local set up a pod netns (inside a node netns the test creates); istio-cni,
    given their result as prevResult, programs the pod's rules in that netns (no dry run) and
    hands the result on unchanged in the same cniVersion."""
    node.kube.add_pod(sidecar_pod())
    host, host_path = await _new_netns()
    pod, pod_path = await _new_netns()
    try:
        bridge_conf = {
            "cniVersion": version,
            "name": "k8s-pod-network",
            "type": "bridge",
            "bridge": "cni0",
            "isGateway": True,
            "ipam": {"type": "host-local", "subnet": "10.244.1.0/24", "dataDir": str(tmp_path / "ipam")},
        }
        env = {**node.env(), "CNI_NETNS": str(pod_path), "CNI_PATH": str(BRIDGE.parent)}
        del env["DRY_RUN_FILE_PATH"]
        process = await asyncio.create_subprocess_exec(
            "nsenter",
            f"--net={host_path}",
            str(BRIDGE),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env},
        )
        out, _ = await process.communicate(json.dumps(bridge_conf).encode())
        assert process.returncode == 0, out.decode()
        bridge_result = json.loads(out)
        assert bridge_result["ips"][0]["address"] == "10.244.1.2/24"
        run = await run_plugin(env, node.config(cniVersion=version, prevResult=bridge_result))
        assert run.code == 0, run.stdout + run.stderr
        assert run.json == bridge_result
        saved = subprocess.run(
            ["nsenter", f"--net={pod_path}", "iptables-save", "-t", "nat"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "-A PREROUTING -p tcp -j ISTIO_INBOUND" in saved
        assert "-A ISTIO_OUTPUT -j ISTIO_REDIRECT" in saved
        assert not node.dry_run.exists()
    finally:
        for holder in (host, pod):
            holder.kill()
            await holder.wait()


@needs_root
async def test_native_nftables_programs_istios_nftables_tables(node: Node) -> None:
    """``native_nftables`` in the plugin's config: the pod gets Istio's inet tables, no iptables rules."""
    node.kube.add_pod(sidecar_pod())
    with netns() as pod:
        env = {**node.env(), "CNI_NETNS": str(pod.path)}
        del env["DRY_RUN_FILE_PATH"]
        run = await run_plugin(env, node.config(native_nftables=True))
        assert run.code == 0, run.stdout + run.stderr
        tables = pod.exec("nft", "list", "tables")
        assert "table inet istio-proxy-nat" in tables
        assert "ISTIO" not in pod.exec("iptables-nft-save") + pod.exec("iptables-legacy-save")
        assert "redirect to :15001" in pod.exec("nft", "list", "table", "inet", "istio-proxy-nat")


async def test_native_nftables_dry_run_writes_the_nft_transaction(node: Node) -> None:
    node.kube.add_pod(sidecar_pod())
    run = await run_plugin(node.env(), node.config(native_nftables=True))
    assert run.code == 0, run.stdout + run.stderr
    written = node.dry_run.read_text()
    assert "add table inet istio-proxy-nat" in written and "iptables" not in written
