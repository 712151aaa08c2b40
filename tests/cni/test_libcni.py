"""The test's CNI runtime (tests/cni/libcni.py, tests/cni/node.py) against Debian's real plugins.

Root only (network namespaces). The chained ``recorder`` is a probe written here: it records what a
runtime handed it and passes the previous result on, as a chained plugin that adds no interface does.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cni.libcni import DEBIAN_PLUGINS, Attachment, CniError, NetworkList
from tests.cni.netns import netns
from tests.cni.node import GATEWAY, SUBNET, running_node

CANNOT_RUN = (
    "CNI tests need root (network namespaces); CI runs as root"
    if os.geteuid() != 0
    else "needs Debian's containernetworking-plugins (`make` installs them)"
    if not (DEBIAN_PLUGINS / "bridge").exists()
    else None
)
pytestmark = pytest.mark.skipif(CANNOT_RUN is not None, reason=CANNOT_RUN or "")

RECORDER = f"""#!{sys.executable}
import json, os, sys
config = json.load(sys.stdin)
with open(config["record"], "a") as out:
    env = {{k: v for k, v in os.environ.items() if k.startswith("CNI_")}}
    out.write(json.dumps({{"tag": config["tag"], "env": env, "config": config}}) + "\\n")
if "fail" in config:
    print(json.dumps({{"cniVersion": config["cniVersion"], **config["fail"]}}))
    sys.exit(1)
if os.environ["CNI_COMMAND"] == "ADD":
    print(json.dumps(config.get("prevResult") or {{"cniVersion": config["cniVersion"]}}))
"""


@pytest.fixture
def recorder(tmp_path: Path) -> Path:
    directory = tmp_path / "bin"
    directory.mkdir()
    (directory / "recorder").write_text(RECORDER)
    (directory / "recorder").chmod(0o755)
    return directory


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bridge_and_host_local_attach_a_pod_and_del_leaves_nothing(tmp_path: Path) -> None:
    with running_node(tmp_path / "node") as node:
        pod = node.attach("web", "shop")
        assert pod.result["cniVersion"] == "1.0.0"
        assert pod.ip in [str(ip) for ip in SUBNET.hosts()] and pod.ip != GATEWAY
        assert "default via 10.22.0.1 dev eth0" in pod.netns.ip("route")
        with node.socket() as listener, pod.netns.socket() as client:  # pod -> the node's side of the bridge
            listener.bind((GATEWAY, 9000))
            listener.listen()
            client.settimeout(3)
            client.connect((GATEWAY, 9000))
            assert listener.accept()[1][0] == pod.ip
        node.runtime.check(node.network(), pod.attachment, pod.result)
        store = node.ipam_dir / node.network().name
        assert (store / pod.ip).exists()  # host-local's allocation, in the test's directory

        node.detach("web")

        assert not (store / pod.ip).exists()
        assert not pod.netns.path.exists()
        links = node.netns.ip("-o", "link")
        assert "veth" not in links and "cni0" in links  # the bridge goes with the node's namespace
        node_netns = node.netns.path
    assert not node_netns.exists()


def test_each_plugin_gets_the_list_and_the_previous_result_and_del_runs_in_reverse(
    tmp_path: Path, recorder: Path
) -> None:
    record = tmp_path / "record.jsonl"
    with running_node(tmp_path / "node", plugin_paths=[recorder]) as node:
        node.extra_plugins += [{"type": "recorder", "tag": tag, "record": str(record)} for tag in ("a", "b")]
        pod = node.attach("web", "shop")
        node.detach("web")

    seen = records(record)
    assert [(r["tag"], r["env"]["CNI_COMMAND"]) for r in seen] == [
        ("a", "ADD"), ("b", "ADD"), ("b", "DEL"), ("a", "DEL"),
    ]  # fmt: skip
    bridge_result = seen[0]["config"]["prevResult"]
    assert pod.ip in json.dumps(bridge_result)
    for entry in seen:
        config, env = entry["config"], entry["env"]
        assert (config["name"], config["cniVersion"]) == ("k8s-pod-network", "1.0.0")
        assert config["prevResult"] == bridge_result  # ADD: the previous; DEL: the cached
        assert env["CNI_NETNS"] == str(pod.netns.path) and env["CNI_IFNAME"] == "eth0"
        assert "K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web" in env["CNI_ARGS"]
        assert env["CNI_PATH"] == f"{recorder}:{DEBIAN_PLUGINS}"


def test_a_plugin_error_result_is_raised_with_its_code_and_message(tmp_path: Path, recorder: Path) -> None:
    with running_node(tmp_path / "node", plugin_paths=[recorder]) as node, netns("web") as sandbox:
        attachment = Attachment.for_pod("c1", sandbox.path, "default", "web")
        fail = {"code": 7, "msg": "no", "details": "why"}
        failing = {"type": "recorder", "tag": "x", "record": str(tmp_path / "r"), "fail": fail}
        with pytest.raises(CniError) as caught:
            node.runtime.add(NetworkList("net", "1.0.0", (failing,)), attachment)
        error = caught.value
        assert (error.plugin, error.command, error.code, error.msg, error.details) == (
            "recorder",
            "ADD",
            7,
            "no",
            "why",
        )
        # Debian's bridge refusing a bad IPAM config: a real plugin's error result
        bad = {"type": "bridge", "ipam": {"type": "host-local", "ranges": [[{"subnet": "not-a-cidr"}]]}}
        with pytest.raises(CniError) as real:
            node.runtime.add(NetworkList("net", "1.0.0", (bad,)), attachment)
        assert (real.value.plugin, real.value.code, real.value.msg) == (
            "bridge",
            999,  # the spec's "generic error", which Go's skel uses for a plain error
            "invalid CIDR address: not-a-cidr",
        )
        with pytest.raises(CniError, match="plugin 'nope' is not in"):
            node.runtime.add(NetworkList("net", "1.0.0", ({"type": "nope"},)), attachment)
