"""The self-contained istio-cni (``make cni-plugin``, packaging/cni-plugin/) as a node runs it.

A node's root may offer only the kernel, ``/bin/sh`` and its iptables binaries: no Python, and a C
library of any version (or musl, or none in ``/lib``). The node root here is exactly that, minus
iptables (these commands run none): Debian's static busybox as ``/bin/sh``, the plugin directory in
``/opt/cni/bin``, ``/proc``, install-cni's kubeconfig; the plugin runs in it through
``unshare --mount --mount-proc --root``, as containerd would exec it on the host. That the root
really lacks a Python is checked too: the venv's console script, copied in, cannot run there.

The bundle is built by ``make cni-plugin`` (``make test`` depends on it); a missing one fails here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cni.test_plugin_exec import PREV_RESULT

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "build" / "cni" / "bin"
PLUGIN = BIN / "istio-cni"
RUNTIME = BIN / "istio-cni-runtime"
VENV_PLUGIN = Path(sys.executable).parent / "istio-cni"
BUSYBOX = Path("/bin/busybox")
RUN_DIR = "/var/run/istio-cni"
NETNS = "/var/run/netns/pod"
KUBECONFIG = {
    "apiVersion": "v1",
    "kind": "Config",
    "clusters": [
        {"name": "local", "cluster": {"server": "https://127.0.0.1:1", "insecure-skip-tls-verify": True}}
    ],
    "contexts": [{"name": "ctx", "context": {"cluster": "local", "user": "istio-cni"}}],
    "current-context": "ctx",
    "users": [{"name": "istio-cni", "user": {"token": "not-used"}}],
}
"""Read by the ADD (install-cni writes one on every node); a pod that is skipped never reaches the server."""


def _static_busybox() -> bool:
    if not BUSYBOX.is_file():
        return False
    ldd = subprocess.run(["ldd", str(BUSYBOX)], capture_output=True, text=True, check=False)
    return "not a dynamic executable" in ldd.stdout + ldd.stderr


CAN_MAKE_NODE_ROOT = os.geteuid() == 0 and shutil.which("unshare") is not None and _static_busybox()
NODE_ROOT_NEEDS = "root, util-linux's unshare and Debian's busybox-static (/bin/busybox) for a node root"
needs_node_root = pytest.mark.skipif(not CAN_MAKE_NODE_ROOT, reason=f"needs {NODE_ROOT_NEEDS}")


@pytest.fixture(scope="module")
def bundle() -> Path:
    if not PLUGIN.is_file():
        pytest.fail(f"{PLUGIN} is missing: build it with `make cni-plugin` (`make test` does)")
    return BIN


def node_root(directory: Path, plugin_dir: Path = BIN) -> Path:
    """A node's root at ``directory``: /bin/sh (static busybox), the plugin dir in /opt/cni/bin, the
    mount point for /proc, install-cni's kubeconfig and a pod netns path; nothing else."""
    (directory / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, directory / "bin" / "busybox")
    (directory / "bin" / "sh").symlink_to("busybox")
    (directory / "opt" / "cni").mkdir(parents=True)
    shutil.copytree(plugin_dir, directory / "opt" / "cni" / "bin", symlinks=True)
    (directory / "proc").mkdir()
    run_dir = directory / RUN_DIR.lstrip("/")
    run_dir.mkdir(parents=True)
    (run_dir / "istio-cni-kubeconfig").write_text(json.dumps(KUBECONFIG))
    netns = directory / NETNS.lstrip("/")
    netns.parent.mkdir(parents=True)
    netns.touch()  # the plugin checks it is not its own netns; a skipped pod's is never entered
    return directory


def add_env(**extra: str) -> dict[str, str]:
    """A container runtime's ADD for a sandbox that is not a Kubernetes pod (no K8S_POD_NAME)."""
    return {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "abc123",
        "CNI_NETNS": NETNS,
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
        "CNI_ARGS": "IgnoreUnknown=1",
        **extra,
    }


def add_config() -> dict[str, Any]:
    return {
        "cniVersion": "1.0.0",
        "name": "k8s-pod-network",
        "type": "istio-cni",
        "cni_agent_run_dir": RUN_DIR,
        "pod_namespace": "istio-system",
        "exclude_namespaces": ["istio-system"],
        "prevResult": PREV_RESULT,
    }


def run_in_root(
    root: Path, env: dict[str, str], stdin: bytes = b"", program: str = "/opt/cni/bin/istio-cni"
) -> subprocess.CompletedProcess[bytes]:
    """``program`` exec'd in ``root`` with /proc mounted (a private mount namespace: nothing leaks)."""
    return subprocess.run(
        ["unshare", "--mount", "--mount-proc", f"--root={root}", program],
        env=env,
        input=stdin,
        capture_output=True,
        timeout=30,
        check=False,
    )


# -- the directory ----------------------------------------------------------------------------------


def test_the_directory_holds_the_launcher_and_its_runtime_only(bundle: Path) -> None:
    assert sorted(p.name for p in bundle.iterdir()) == ["istio-cni", "istio-cni-runtime"]
    assert PLUGIN.read_text().startswith("#!/bin/sh\n")
    assert os.access(PLUGIN, os.X_OK)
    links = [p for p in RUNTIME.rglob("*") if p.is_symlink()]
    assert links == [], "install-cni copies files: a link could name a path the host lacks"


def test_every_library_resolves_inside_the_bundle(bundle: Path) -> None:
    """The bundled loader, asked as it will load them, finds every library in the bundle's lib/."""
    lib = RUNTIME / "lib"
    loaders = sorted(lib.glob("ld-*.so*"))
    assert len(loaders) == 1, loaders
    elves = [p for p in RUNTIME.rglob("*") if p.is_file() and p.read_bytes()[:4] == b"\x7fELF"]
    assert len(elves) > 20
    outside: list[str] = []
    for elf in elves:
        listed = subprocess.run(
            [str(loaders[0]), "--inhibit-cache", "--library-path", str(lib), "--list", str(elf)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert listed.returncode == 0, f"{elf}: {listed.stderr}"
        for line in listed.stdout.splitlines():
            if "=>" in line:
                target = line.split("=>")[1].split("(")[0].strip()
                if not Path(target).resolve().is_relative_to(lib.resolve()):
                    outside.append(f"{elf.relative_to(RUNTIME)}: {line.strip()}")
    assert outside == []


def test_it_answers_as_the_venv_script_does(bundle: Path, tmp_path: Path) -> None:
    """Same bytes on stdout as the package's own console script, for VERSION and a skipped ADD."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "istio-cni-kubeconfig").write_text(json.dumps(KUBECONFIG))
    netns = tmp_path / "netns"
    netns.touch()
    config = json.dumps({**add_config(), "cni_agent_run_dir": str(run_dir)}).encode()
    for env, stdin in (
        ({"CNI_COMMAND": "VERSION"}, b""),
        (add_env(CNI_NETNS=str(netns)), config),
    ):
        ours = subprocess.run(
            [str(PLUGIN)], env=env, input=stdin, capture_output=True, timeout=30, check=False
        )
        venv = subprocess.run(
            [str(VENV_PLUGIN)], env=env, input=stdin, capture_output=True, timeout=30, check=False
        )
        assert (ours.returncode, ours.stdout) == (venv.returncode, venv.stdout), ours.stderr.decode()
        assert ours.returncode == 0


# -- in a node's root -------------------------------------------------------------------------------


@needs_node_root
def test_the_node_root_has_no_python(bundle: Path, tmp_path: Path) -> None:
    """The root is honest: the venv's console script (the plugin install-cni copied before) fails there."""
    root = node_root(tmp_path / "root")
    shutil.copy2(VENV_PLUGIN, root / "opt" / "cni" / "bin" / "venv-istio-cni")
    run = run_in_root(root, {"CNI_COMMAND": "VERSION"}, program="/opt/cni/bin/venv-istio-cni")
    assert run.returncode != 0
    assert b"supportedVersions" not in run.stdout
    assert not any((root / d).exists() for d in ("lib", "lib64", "usr"))


@needs_node_root
@pytest.mark.parametrize(
    "locale", [None, "C.UTF-8", "en_US.UTF-8"], ids=["no-LANG", "LANG-C.UTF-8", "LANG-without-locale-files"]
)
def test_version_in_a_node_root(bundle: Path, tmp_path: Path, locale: str | None) -> None:
    root = node_root(tmp_path / "root")
    env = {"CNI_COMMAND": "VERSION", **({"LANG": locale} if locale else {})}
    run = run_in_root(root, env)
    assert run.returncode == 0, run.stderr.decode()
    answer = json.loads(run.stdout)
    assert answer["cniVersion"] == "1.1.0"
    assert "0.3.1" in answer["supportedVersions"] and "1.0.0" in answer["supportedVersions"]


@needs_node_root
def test_a_skipped_pod_gets_its_previous_result_in_a_node_root(bundle: Path, tmp_path: Path) -> None:
    root = node_root(tmp_path / "root")
    run = run_in_root(root, add_env(), json.dumps(add_config()).encode())
    assert run.returncode == 0, run.stderr.decode()
    assert json.loads(run.stdout) == PREV_RESULT
    assert b"not a kubernetes pod" in run.stderr  # the decision is logged, and logging works


@needs_node_root
def test_bad_input_gets_a_cni_error_in_a_node_root(bundle: Path, tmp_path: Path) -> None:
    root = node_root(tmp_path / "root")
    run = run_in_root(root, add_env(), b"{not json")
    assert run.returncode == 1
    error = json.loads(run.stdout)
    assert error["code"] == 6 and error["msg"]
    assert b"Traceback" not in run.stderr
