"""The two images ``make images`` builds (packaging/images/), read from their archives as they ship.

Their configs against Istio's Dockerfiles (``pilot/docker/Dockerfile.proxyv2``,
``cni/deployments/kubernetes/Dockerfile.install-cni``), their roots' layout, and their programs run in
the root with nothing of this machine's: ``chroot`` into a read-only mount of the unpacked root, the
image's ENV only. The pod-shaped tests run the proxy image as a pod does (tests/e2e/test_pod_sidecar.py).
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import tempfile
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from tests.cni.test_plugin_bundle import (
    CAN_MAKE_NODE_ROOT,
    NODE_ROOT_NEEDS,
    PREV_RESULT,
    add_config,
    add_env,
    node_root,
    run_in_root,
)
from tests.images.built import ROOT, image, image_root, unavailable

PROXY = "proxyv2"
INSTALL_CNI = "install-cni"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
VENV = "/opt/istio-agent"
pytestmark = pytest.mark.e2e  # they run what `make images` built (make test builds it as root)


def needs(name: str) -> pytest.MarkDecorator:
    reason = unavailable(name)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def run_in_image(
    name: str,
    argv: Sequence[str],
    *,
    user: str = "0:0",
    env: Mapping[str, str] | None = None,
    own_network: bool = False,
    timeout: float = 30,
) -> subprocess.CompletedProcess[str]:
    """``argv`` in the image's root, read-only, as ``user`` (uid:gid), with the image's ENV (or ``env``)
    and nothing else: a private mount namespace, the root bind-mounted read-only with its own /proc;
    with ``own_network``, a network namespace of its own too (a pod's)."""
    environment = image(name).env() if env is None else dict(env)
    script = (
        'set -e; mount --bind "$1" "$2"; mount -o remount,bind,ro "$2"; mount -t proc proc "$2/proc"; '
        'root=$2 user=$3; shift 3; exec chroot --userspec="$user" "$root" "$@"'
    )
    with tempfile.TemporaryDirectory(prefix="image-root-") as mount_point:
        command = ["unshare", "--mount", "--propagation", "private", *(["--net"] if own_network else [])]
        command += ["--", "bash", "-c", script, "bash"]
        command += [str(image_root(name)), mount_point, user, "/usr/bin/env", "-i"]
        command += [f"{key}={value}" for key, value in environment.items()] + list(argv)
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


def passwd_entry(name: str, login: str, database: str = "passwd") -> list[str]:
    for line in (image_root(name) / "etc" / database).read_text().splitlines():
        if line.split(":")[0] == login:
            return line.split(":")
    raise AssertionError(f"{login} is not in the image's /etc/{database}")


# -- both images ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [PROXY, INSTALL_CNI])
def test_the_archive_holds_one_image_named_for_this_version(name: str) -> None:
    if (reason := unavailable(name)) is not None:
        pytest.skip(reason)
    built = image(name)
    assert built.name == f"localhost/istio-agent/{name}:{VERSION}"
    assert built.config["os"] == "linux" and len(built.layers) == 1
    assert built.settings.get("User", "") == ""  # root by default, as Istio's: the pod spec sets the user


@pytest.mark.parametrize("name", [PROXY, INSTALL_CNI])
def test_the_root_has_the_proxy_user_and_nothing_of_the_build_host(name: str) -> None:
    if (reason := unavailable(name)) is not None:
        pytest.skip(reason)
    assert passwd_entry(name, "istio-proxy")[2:4] == ["1337", "1337"]
    assert passwd_entry(name, "istio-proxy", "group")[2] == "1337"
    etc = image_root(name) / "etc"
    assert (etc / "resolv.conf").read_text() == "" and (etc / "hostname").read_text() == ""
    assert (etc / "hosts").read_text().startswith("127.0.0.1\tlocalhost\n")
    share = image_root(name) / "usr" / "share"  # no man pages or translations (docs: licences only)
    assert [p for d in ("man", "locale") for p in (share / d).rglob("*") if p.is_file()] == []
    assert {p.name for p in (share / "doc").rglob("*") if p.is_file()} == {"copyright"}


@pytest.mark.parametrize("name", [PROXY, INSTALL_CNI])
def test_every_module_of_the_agent_is_compiled_in_the_image(name: str) -> None:
    """The root file system is read-only in a pod: bytecode written at run time would be lost each start."""
    if (reason := unavailable(name)) is not None:
        pytest.skip(reason)
    venv = image_root(name) / VENV.lstrip("/")
    sources = list(venv.rglob("*.py"))
    assert len(sources) > 1000
    missing = [s for s in sources if not Path(importlib.util.cache_from_source(str(s))).is_file()]
    assert missing == []
    script = (venv / "bin" / "pilot-agent").read_text().splitlines()[0]
    assert script == f"#!{VENV}/bin/python", "the console scripts name the image's venv"


@pytest.mark.parametrize("name", [PROXY, INSTALL_CNI])
def test_the_agent_runs_in_the_image_as_the_proxy_user(name: str) -> None:
    if (reason := unavailable(name)) is not None:
        pytest.skip(reason)
    result = run_in_image(name, ["pilot-agent", "version"], user="1337:1337")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f'version.BuildInfo{{Version:"{VERSION}"'), result.stdout


# -- the proxy image --------------------------------------------------------------------------------------
@needs(PROXY)
def test_the_proxy_image_config_is_istios_proxyv2() -> None:
    settings = image(PROXY).settings
    assert settings["Entrypoint"] == ["/usr/local/bin/pilot-agent"]
    assert settings.get("Cmd") is None and settings["WorkingDir"] == "/"
    env = image(PROXY).env()
    assert env["PATH"] == PATH and env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["ISTIO_META_ISTIO_PROXY_SHA"].startswith("envoy:")


@needs(PROXY)
def test_envoy_runs_in_the_proxy_image_and_is_the_one_its_sha_names() -> None:
    result = run_in_image(PROXY, ["/usr/local/bin/envoy", "--version"], user="1337:1337")
    assert result.returncode == 0, result.stderr
    sha = image(PROXY).env()["ISTIO_META_ISTIO_PROXY_SHA"].removeprefix("envoy:")
    assert f"version: {sha}/" in result.stdout


@needs(PROXY)
def test_istio_init_can_run_from_the_proxy_image() -> None:
    """istio-init and istio-validation use the proxy image: istio-iptables and both iptables backends."""
    args = ["pilot-agent", "istio-iptables", "-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT"]
    args += ["-i", "*", "-x", "", "-b", "*", "-d", "15090,15021,15020", "--dry-run"]
    result = run_in_image(PROXY, args)
    assert result.returncode == 0, result.stderr
    assert "-A ISTIO_OUTPUT" in result.stdout and "COMMIT" in result.stdout
    for tool in ("iptables-nft", "iptables-legacy", "ip6tables-nft", "nft"):
        version = run_in_image(PROXY, [tool, "--version"])
        assert version.returncode == 0, f"{tool}: {version.stderr}"


@needs(PROXY)
def test_istio_init_applies_the_rules_from_the_proxy_image() -> None:
    """istio-init's command, as root in a pod's network namespace, with the image's iptables only."""
    args = ["pilot-agent", "istio-iptables", "-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT"]
    args += ["-i", "*", "-x", "", "-b", "*", "-d", "15090,15021,15020"]
    script = f"{shlex.join(args)} && echo SAVED: && iptables-save -t nat"
    result = run_in_image(PROXY, ["sh", "-c", script], own_network=True)
    assert result.returncode == 0, result.stderr
    saved = result.stdout.partition("SAVED:\n")[2]  # what the image's iptables reads back
    assert "-A OUTPUT -j ISTIO_OUTPUT" in saved
    assert "-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001" in saved


# -- the install-cni image --------------------------------------------------------------------------------
@needs(INSTALL_CNI)
def test_the_install_cni_image_config_is_istios() -> None:
    settings = image(INSTALL_CNI).settings
    assert settings["Cmd"] == ["/usr/local/bin/install-cni"] and settings.get("Entrypoint") is None
    assert settings["WorkingDir"] == "/opt/cni/bin"
    assert settings["Labels"]["description"] == "Istio CNI plugin installer."
    assert image(INSTALL_CNI).env()["PATH"] == PATH + ":/opt/cni/bin"


@needs(INSTALL_CNI)
def test_install_cni_and_its_modules_load_in_the_image() -> None:
    result = run_in_image(INSTALL_CNI, ["install-cni", "--help"])
    assert result.returncode == 0 and "--repair-enabled" in result.stdout, result.stderr
    package = (
        image_root(INSTALL_CNI) / VENV.lstrip("/") / "lib/python3.11/site-packages/istio_agent/cni/install"
    )
    modules = sorted(
        f"istio_agent.cni.install.{p.stem}" for p in package.glob("*.py") if p.stem != "__init__"
    )
    load = run_in_image(
        INSTALL_CNI, ["python3", "-c", f"import {', '.join(modules)}"], env={"PATH": f"{VENV}/bin"}
    )
    assert load.returncode == 0, load.stderr


@needs(INSTALL_CNI)
@pytest.mark.skipif(not CAN_MAKE_NODE_ROOT, reason=f"needs {NODE_ROOT_NEEDS}")
def test_the_plugin_the_image_ships_runs_on_a_node_without_python(tmp_path: Path) -> None:
    """install-cni copies /opt/cni/bin to the host: that copy works in a bare node root (busybox only)."""
    shipped = image_root(INSTALL_CNI) / "opt" / "cni" / "bin"
    assert sorted(p.name for p in shipped.iterdir()) == ["istio-cni", "istio-cni-runtime"]
    node = node_root(tmp_path / "node", plugin_dir=shipped)
    version = run_in_root(node, {"CNI_COMMAND": "VERSION"})
    assert version.returncode == 0, version.stderr.decode()
    assert "1.1.0" in json.loads(version.stdout)["supportedVersions"]
    add = run_in_root(node, add_env(), json.dumps(add_config()).encode())  # not a Kubernetes pod: skipped
    assert add.returncode == 0, add.stderr.decode()
    assert json.loads(add.stdout) == PREV_RESULT
