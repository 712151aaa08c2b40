"""A small container runtime's side of CNI: executing a network configuration list as libcni does.

Debian has the reference plugins (``/usr/lib/cni``) but no ``cnitool``, so the tests run a conflist
themselves, following the CNI spec (``SPEC.md``, "Execution of Network Configurations") and libcni
(``libcni/api.go`` of containernetworking/cni):

- ADD runs the plugins in order; each gets its own entry plus the list's ``name`` and ``cniVersion``
  and, from the second on, the previous plugin's result as ``prevResult``. The last result is the
  attachment's result (the runtime caches it).
- CHECK runs them in order and DEL in reverse, each with the cached result as ``prevResult``.
- The parameters are environment variables: ``CNI_COMMAND``, ``CNI_CONTAINERID``, ``CNI_NETNS``,
  ``CNI_IFNAME``, ``CNI_ARGS`` (``K8S_POD_NAMESPACE=..;K8S_POD_NAME=..;...`` as the kubelet's CRI
  runtime passes them) and ``CNI_PATH``; the configuration is stdin.
- A plugin that fails exits non-zero with an error result (``code``, ``msg``, ``details``) on stdout:
  :class:`CniError`.

The plugins run in the runtime's network namespace (``runtime_netns``): a test gives the "node" a
namespace of its own, so the bridge and its host-side addresses never touch the machine's network.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.cni.netns import in_netns

DEBIAN_PLUGINS = Path("/usr/lib/cni")
"""containernetworking-plugins' directory on Debian (CNI spec up to 1.0.0)."""
PLUGIN_TIMEOUT = 30.0


class CniError(Exception):
    """A plugin's error result (or a plugin that could not run, or answered something that is not JSON)."""

    def __init__(self, plugin: str, command: str, code: int, msg: str, details: str = "") -> None:
        self.plugin, self.command = plugin, command
        self.code, self.msg, self.details = code, msg, details
        super().__init__(f"{plugin} {command}: code {code}: {msg}" + (f" ({details})" if details else ""))


@dataclass(frozen=True)
class NetworkList:
    """A network configuration list (a ``.conflist``): the plugins run for every attachment."""

    name: str
    cni_version: str
    plugins: tuple[Mapping[str, Any], ...]

    @classmethod
    def from_document(cls, document: Mapping[str, Any]) -> NetworkList:
        plugins = document.get("plugins")
        if not isinstance(plugins, list) or not plugins or not all(isinstance(p, dict) for p in plugins):
            raise ValueError("a network configuration list needs a non-empty plugins list of objects")
        if not all(isinstance(p.get("type"), str) and p["type"] for p in plugins):
            raise ValueError("every plugin of the list needs a type")
        return cls(str(document["name"]), str(document["cniVersion"]), tuple(plugins))

    def document(self) -> dict[str, Any]:
        return {"cniVersion": self.cni_version, "name": self.name, "plugins": [dict(p) for p in self.plugins]}


@dataclass(frozen=True)
class Attachment:
    """One container's attachment to the network: what the runtime passes in the CNI_* variables."""

    container_id: str
    netns: Path
    ifname: str = "eth0"
    args: Mapping[str, str] = field(default_factory=dict)
    """CNI_ARGS, e.g. K8S_POD_NAMESPACE, K8S_POD_NAME, K8S_POD_INFRA_CONTAINER_ID, K8S_POD_UID."""

    @classmethod
    def for_pod(cls, container_id: str, netns: Path, namespace: str, name: str, uid: str = "") -> Attachment:
        """As the kubelet's CRI runtime attaches a pod sandbox."""
        args = {"IgnoreUnknown": "1", "K8S_POD_NAMESPACE": namespace, "K8S_POD_NAME": name}
        args["K8S_POD_INFRA_CONTAINER_ID"] = container_id
        if uid:
            args["K8S_POD_UID"] = uid
        return cls(container_id, netns, args=args)

    def cni_args(self) -> str:
        return ";".join(f"{key}={value}" for key, value in self.args.items())


class Runtime:
    """Executes network configuration lists; plugins are looked up in ``paths`` (CNI_PATH)."""

    def __init__(
        self,
        paths: Sequence[Path] = (DEBIAN_PLUGINS,),
        *,
        runtime_netns: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.paths = tuple(paths)
        self.runtime_netns = runtime_netns
        self.env = dict(env or {})
        """Extra environment for every plugin (e.g. what a plugin under test reads); as libcni, a
        plugin also gets the runtime's own environment."""

    def add(self, network: NetworkList, attachment: Attachment) -> dict[str, Any]:
        """ADD: every plugin in order, each given the previous result; the final result."""
        result: dict[str, Any] | None = None
        for plugin in network.plugins:
            answer = self._exec("ADD", network, plugin, attachment, result)
            if not answer:
                raise CniError(str(plugin["type"]), "ADD", 999, "the plugin printed no result")
            result = answer
        assert result is not None  # a list has at least one plugin
        return result

    def check(self, network: NetworkList, attachment: Attachment, result: Mapping[str, Any]) -> None:
        """CHECK: every plugin in order, each given the cached result."""
        for plugin in network.plugins:
            self._exec("CHECK", network, plugin, attachment, result)

    def delete(
        self, network: NetworkList, attachment: Attachment, result: Mapping[str, Any] | None = None
    ) -> None:
        """DEL: every plugin in reverse order, each given the cached result (if the runtime has one)."""
        for plugin in reversed(network.plugins):
            self._exec("DEL", network, plugin, attachment, result)

    def version(self, plugin_type: str) -> dict[str, Any]:
        """VERSION: which spec versions the plugin supports."""
        plugin = {"type": plugin_type}
        probe = NetworkList("version", "1.0.0", (plugin,))
        return self._exec("VERSION", probe, plugin, None, None) or {}

    def run_plugin(
        self,
        command: str,
        network: NetworkList,
        plugin: Mapping[str, Any],
        attachment: Attachment,
        prev_result: Mapping[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """One plugin of ``network``, exec'd as ADD/CHECK/DEL exec each (bench/cni.py times them one by one)."""
        return self._exec(command, network, plugin, attachment, prev_result)

    def find(self, plugin_type: str) -> Path:
        for directory in self.paths:
            candidate = directory / plugin_type
            if candidate.is_file():
                return candidate
        raise CniError(
            plugin_type, "find", 999, f"plugin {plugin_type!r} is not in {list(map(str, self.paths))}"
        )

    def _exec(
        self,
        command: str,
        network: NetworkList,
        plugin: Mapping[str, Any],
        attachment: Attachment | None,
        prev_result: Mapping[str, Any] | None,
    ) -> dict[str, Any] | None:
        plugin_type = str(plugin["type"])
        config: dict[str, Any] = {**plugin, "cniVersion": network.cni_version, "name": network.name}
        if prev_result is not None:
            config["prevResult"] = prev_result
        env = {
            **os.environ,
            **self.env,
            "CNI_COMMAND": command,
            "CNI_PATH": ":".join(map(str, self.paths)),
        }
        if attachment is not None:
            env["CNI_CONTAINERID"] = attachment.container_id
            env["CNI_NETNS"] = str(attachment.netns)
            env["CNI_IFNAME"] = attachment.ifname
            env["CNI_ARGS"] = attachment.cni_args()
        argv = [str(self.find(plugin_type))]
        if self.runtime_netns is not None:
            argv = in_netns(self.runtime_netns, argv)
        try:
            done = subprocess.run(
                argv,
                input=json.dumps(config),
                capture_output=True,
                text=True,
                env=env,
                timeout=PLUGIN_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise CniError(plugin_type, command, 999, f"no answer within {PLUGIN_TIMEOUT:.0f}s") from None
        answer = _parse(plugin_type, command, done)
        if done.returncode != 0:
            if answer is None or "code" not in answer:
                stderr = done.stderr.strip()
                raise CniError(
                    plugin_type, command, 999, f"exited {done.returncode} without an error result", stderr
                )
            raise CniError(
                plugin_type,
                command,
                int(answer["code"]),
                str(answer.get("msg", "")),
                str(answer.get("details", "")),
            )
        return answer


def _parse(plugin_type: str, command: str, done: subprocess.CompletedProcess[str]) -> dict[str, Any] | None:
    if not done.stdout.strip():
        return None
    try:
        answer = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise CniError(plugin_type, command, 999, "stdout is not JSON", done.stdout[:500]) from None
    if not isinstance(answer, dict):
        raise CniError(plugin_type, command, 999, "stdout is not a JSON object", done.stdout[:500])
    return answer
