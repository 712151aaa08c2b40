"""The node's CNI config files: which ones a container runtime would load, and putting our entry in or out.

Finding files mirrors kubelet and libcni (``libcni.ConfFiles``, ``ConfFromBytes``,
``ConfListFromBytes``): ``.conf`` and ``.conflist`` files in name order, invalid ones skipped, the
first valid one used. Editing mirrors Istio's install-cni (``cni/pkg/install/cniconfig.go``): a
chained file is read into plain values and written back as Go writes a map (keys sorted at every
level, 2-space indent, numbers as float64), so the file is byte for byte what Istio writes.

Beyond Istio, :func:`chain_problem` checks the whole chain, not only our entry: a file a runtime
would refuse (no name, an empty ``plugins`` list, a plugin without a ``type``) is *corrupt*, and
install-cni leaves it alone and reports it instead of editing a file it cannot understand.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from istio_agent.cni.plugin_config import CNI_VERSION, PLUGIN_TYPE, PluginConfig
from istio_agent.goformat import json_marshal

EXTENSIONS = (".conf", ".conflist")
CHAINED_LIST_NAME = "k8s-pod-network"
"""The name Istio gives the list it makes from a single ``.conf``."""
STANDALONE_NAME = "YYY-istio-cni.conf"
"""Istio's standalone file name: sorts after every usual primary config."""
MAX_CONFIG_BYTES = 1 << 20
"""A CNI config is a few kB; a larger file is refused rather than read."""


class CniConfigError(Exception):
    """A config file cannot be used or edited; the message says which and why."""


class NoNetworksError(CniConfigError):
    """The directory holds no (valid) network config yet."""


def parse(data: bytes) -> Any:
    """A JSON document as Go reads it into ``any``: every number a float64, NaN and infinities refused.

    Raises ValueError (with the parser's position) when the text is not such a document.
    """

    def number(text: str) -> float:
        value = float(text)
        if value in (float("inf"), float("-inf")):
            raise ValueError(f"number {text} out of range of float64")
        return value

    def constant(text: str) -> Any:
        raise ValueError(f"invalid character in JSON: {text}")

    return json.loads(data, parse_int=number, parse_float=number, parse_constant=constant)


def read_document(path: Path) -> Any:
    """The parsed file; raises CniConfigError naming the file (not a regular file, unreadable, too large, not JSON).

    Opened without blocking and read only when regular: a plain open() of a FIFO waits for a writer,
    which would stall install-cni (health, signals and all) on a stray ``*.conflist`` pipe.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise CniConfigError(f"cannot read {path}: {err.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CniConfigError(f"{path} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise CniConfigError(f"cannot read {path}: {err.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise CniConfigError(f"{path} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        return parse(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise CniConfigError(f"{path} is not valid JSON: {err}") from None


def marshal(document: Any) -> bytes:
    """A chained file's text: Go's map marshalling (keys sorted), 2-space indent, final newline."""
    return (json_marshal(document, "  ", sort_keys=True) + "\n").encode()


def standalone_text(plugin: PluginConfig) -> bytes:
    """The standalone file: our entry in Istio's field order, with its cniVersion."""
    return (json_marshal(plugin.plugin_object(with_version=True), "  ") + "\n").encode()


def entry(plugin: PluginConfig) -> dict[str, Any]:
    """Our entry as it stands in a chained list (read back as Go would: the list's cniVersion applies)."""
    value = parse(json.dumps(plugin.plugin_object(with_version=False)).encode())
    assert isinstance(value, dict)
    return value


def _plugin_problem(plugin: Any, where: str) -> str | None:
    if not isinstance(plugin, dict):
        return f"{where} is not an object"
    kind = plugin.get("type")
    if not isinstance(kind, str) or not kind:
        return f"{where} has no type"
    return None


def conf_problem(document: Any) -> str | None:
    """Why libcni would refuse this ``.conf`` (a single plugin), or None."""
    return _plugin_problem(document, "the network config")


def conflist_problem(document: Any, directory: Path) -> str | None:
    """Why libcni would refuse this ``.conflist``, or None.

    A list without ``plugins`` is valid only with plugin files in ``<dir>/<name>/*.conf`` (libcni).
    """
    if not isinstance(document, dict):
        return "the network list is not an object"
    name = document.get("name")
    if not isinstance(name, str) or not name:
        return "the network list has no name"
    if "cniVersion" in document and not isinstance(document["cniVersion"], str):
        return "cniVersion is not a string"
    if "plugins" not in document:
        if any((directory / name).glob("*.conf")):
            return None
        return "the network list has no plugins"
    plugins = document["plugins"]
    if not isinstance(plugins, list) or not plugins:
        return "plugins is not a non-empty list"
    for index, plugin in enumerate(plugins):
        problem = _plugin_problem(plugin, f"plugin {index}")
        if problem:
            return problem
    return None


def file_problem(path: Path) -> str | None:
    """Why a runtime would skip this config file, or None when it would load it."""
    try:
        document = read_document(path)
    except CniConfigError as err:
        return str(err)
    if path.suffix == ".conflist":
        return conflist_problem(document, path.parent)
    return conf_problem(document)


def candidates(directory: Path) -> list[Path]:
    """``.conf`` and ``.conflist`` files (not directories) in byte order of their paths, as libcni lists them."""
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        return []
    files = [p for p in entries if p.suffix in EXTENSIONS and not p.is_dir()]
    return sorted(files, key=lambda p: bytes(p))


def config_filenames(directory: Path) -> tuple[list[str], dict[str, str]]:
    """The names of the valid config files in load order, and the skipped ones with why.

    Raises NoNetworksError when there is no valid file (Istio's "no networks found" / "no valid
    networks found").
    """
    files = candidates(directory)
    if not files:
        raise NoNetworksError(f"no networks found in {directory}")
    valid: list[str] = []
    skipped: dict[str, str] = {}
    for path in files:
        problem = file_problem(path)
        if problem is None:
            valid.append(path.name)
        else:
            skipped[path.name] = problem
    if not valid:
        raise NoNetworksError(f"no valid networks found in {directory}")
    return valid, skipped


def resolve_name(directory: Path, name: str) -> Path | None:
    """The file a configured name means: itself, or its ``.conf``/``.conflist`` twin; None when neither exists."""
    path = directory / name
    if path.exists():
        return path
    if name.endswith(".conf") and (twin := directory / (name + "list")).exists():
        return twin
    if name.endswith(".conflist") and (twin := directory / name.removesuffix("list")).exists():
        return twin
    return None


def _is_ours(plugin: Any) -> bool:
    return isinstance(plugin, dict) and plugin.get("type") == PLUGIN_TYPE


def _without_ours(plugins: list[Any]) -> list[Any]:
    return [p for p in plugins if not _is_ours(p)]


def istio_entries(document: dict[str, Any]) -> list[int]:
    """Indexes of our plugin (``type: istio-cni``) in a list's plugins."""
    plugins = document.get("plugins")
    if not isinstance(plugins, list):
        return []
    return [i for i, p in enumerate(plugins) if _is_ours(p)]


def insert_entry(document: Any, ours: dict[str, Any]) -> dict[str, Any]:
    """The chained document with our entry last (a single ``.conf`` is wrapped into a list first).

    Every earlier entry of ours is dropped (Istio drops the first only), the others keep their order.
    """
    if not isinstance(document, dict):
        raise CniConfigError("the existing CNI config is not a JSON object")
    if "type" in document:
        plugin = {key: value for key, value in document.items() if key != "cniVersion"}
        return {"cniVersion": CNI_VERSION, "name": CHAINED_LIST_NAME, "plugins": [plugin, ours]}
    plugins = document.get("plugins")
    if not isinstance(plugins, list) or not plugins:
        raise CniConfigError("the existing CNI config has no plugins list to chain into")
    return {**document, "plugins": [*_without_ours(plugins), ours]}


def remove_entry(document: Any) -> dict[str, Any]:
    """The document without our entries (cleanup); other plugins keep their order."""
    if not isinstance(document, dict) or not isinstance(document.get("plugins"), list):
        raise CniConfigError("the CNI config has no plugins list")
    return {**document, "plugins": _without_ours(document["plugins"])}


def chain_problem(path: Path, document: Any) -> str | None:
    """Why the chained file at ``path`` cannot be trusted (corrupt or unusable), or None.

    The whole chain is checked as a runtime would load it, not only our entry.
    """
    single = path.suffix == ".conf" or (isinstance(document, dict) and "type" in document)
    if single:
        return conf_problem(document)
    problem = conflist_problem(document, path.parent)
    if problem is None and "plugins" not in document:
        problem = "its plugins are in a plugin directory, which install-cni cannot chain into"
    return problem


def load_chained(path: Path) -> tuple[Any, str | None]:
    """The file's document and why it is corrupt or unusable for chaining (None when it is fine)."""
    try:
        document = read_document(path)
    except CniConfigError as err:
        return None, str(err)
    return document, chain_problem(path, document)


def corrupt_reason(path: Path, problem: str) -> str:
    """The log line and readiness reason for a corrupt file left alone."""
    return f"CNI config file {path} is corrupt and left alone until it is fixed: {problem}"
