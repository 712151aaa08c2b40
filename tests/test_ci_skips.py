"""Under CI=true, skips for want of root, a Debian tool or overlayfs fail the run (tests/ci_skips.py);
other skips stay skips. Checked in a pytest of its own, with the suite's conftest as its plugin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ci_skips import in_ci, unmet_want
from tests.cni.netns import needs_root

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = """
import pytest

def test_wants_root():
    pytest.skip("needs root and iproute2 to create network namespaces (CI runs as root)")

@pytest.mark.skipif(True, reason="pod-shaped tests need overlayfs (mount points of the read-only image)")
def test_wants_overlayfs():
    pass

@pytest.fixture
def dnsmasq():
    pytest.skip("dnsmasq is not installed (Debian package dnsmasq-base; `make` installs it)")

def test_wants_a_debian_tool(dnsmasq):
    pass

def test_the_machine_has_no_ipv6():
    pytest.skip("no IPv6")

@pytest.mark.xfail(reason="needs root, expected to fail")
def test_an_expected_failure():
    assert False

def test_passes():
    pass
"""
SKIPPED_MODULE = 'import pytest\npytest.skip("dig is not installed", allow_module_level=True)\n'


def pytest_run(directory: Path, ci: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key not in ("CI", "PYTEST_ADDOPTS")}
    if ci is not None:
        env["CI"] = ci
    argv = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "-p", "tests.conftest"]
    argv += ["-p", "no:cacheprovider", "-rs", *args]
    return subprocess.run(
        [*argv, str(directory)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    return tmp_path


def test_outside_ci_every_skip_is_a_skip(sample: Path) -> None:
    done = pytest_run(sample, None)
    assert done.returncode == 0, done.stdout
    assert "1 passed, 4 skipped, 1 xfailed" in done.stdout
    assert "test_sample.py:5: needs root and iproute2" in done.stdout  # -rs: the reasons


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["in-process", "xdist"])
def test_under_ci_a_want_of_root_a_debian_tool_or_overlayfs_fails(sample: Path, workers: list[str]) -> None:
    done = pytest_run(sample, "true", *workers)
    assert done.returncode == 1, done.stdout
    out = done.stdout
    assert (
        "CI=true: this test skipped for want of root, which CI must provide: needs root and iproute2" in out
    )
    assert "for want of overlayfs, which CI must provide: pod-shaped tests need overlayfs" in out
    assert "for want of a Debian tool, which CI must provide: dnsmasq is not installed" in out
    assert "test_sample.py:19: no IPv6" in out  # not a want of CI's: still a skip
    assert "1 failed, 1 passed, 1 skipped, 1 xfailed, 2 errors" in out  # skipif and fixtures: setup


def test_under_ci_a_module_skipped_at_collection_fails(tmp_path: Path) -> None:
    (tmp_path / "test_dig.py").write_text(SKIPPED_MODULE)
    assert pytest_run(tmp_path, None).returncode == pytest.ExitCode.NO_TESTS_COLLECTED
    done = pytest_run(tmp_path, "true")
    assert done.returncode == pytest.ExitCode.INTERRUPTED, done.stdout  # a collection error
    assert "for want of a Debian tool, which CI must provide: dig is not installed" in done.stdout


def test_ci_is_true_or_1() -> None:
    assert in_ci({"CI": "true"}) and in_ci({"CI": "TRUE"}) and in_ci({"CI": "1"})
    assert not in_ci({}) and not in_ci({"CI": "false"}) and not in_ci({"CI": ""})


WANTED = [
    # the reasons the suite gives today for what CI provides, as written where the test skips
    ("root", str(needs_root.kwargs["reason"])),  # tests/cni/netns.py
    ("root", "CNI tests need root (network namespaces); CI runs as root"),  # tests/cni/test_libcni.py
    ("root", "needs root: creates network namespaces"),  # tests/cni/test_plugin_exec.py
    ("root", "pod-shaped tests need root (namespaces, mounts, setpriv); CI runs as root"),  # tests/e2e/pod.py
    ("root", "the upstream must listen on port 53 to be named in resolv.conf (run as root)"),  # tests/dns
    ("a Debian tool", "needs Debian's containernetworking-plugins (`make` installs them)"),
    ("a Debian tool", "/usr/lib/cni/bridge missing: apt-get install containernetworking-plugins"),
    ("a Debian tool", "iptables-legacy is not usable here: iptables-legacy-save --version failed"),
    ("a Debian tool", "pod-shaped tests need unshare, setpriv (util-linux, iproute2)"),
    ("a Debian tool", "needs Debian's containernetworking-plugins and iptables (`make` installs them)"),
    ("a Debian tool", "needs Debian's curl (the app's HTTP client)"),
    ("a Debian tool", "needs the istio-cni executable: reinstall the package (pip install -e .)"),
    ("a Debian tool", "dnsmasq is not installed (Debian package dnsmasq-base; `make` installs it)"),
    ("a Debian tool", "dnsperf is not installed"),
    ("a Debian tool", "dig is not installed (Debian package bind9-dnsutils; `make` installs it)"),
    ("root", "an image's root file system needs root (its files' owners); CI runs as root"),  # tests/images
    (
        "a Debian tool",
        "proxyv2.tar is missing: build it with `make images` (`make test` does as root; it needs Debian's"
        " mmdebstrap and buildah, which `make` installs)",
    ),
    ("overlayfs", "pod-shaped tests need overlayfs (mount points of the read-only image)"),
    ("overlayfs", "running a program as uid 1337 from here needs overlayfs: /root closed to it"),
]
NOT_WANTED = [
    # what root cannot be, or what the machine's network happens to offer
    "root writes anywhere: a non-writable directory needs a non-root user",  # tests/cni/install
    "root can watch any directory",  # tests/test_filewatch.py
    "no IPv6 loopback here: [Errno 99] Cannot assign requested address",
    "no IPv6",
    "cannot bind ::1",
    "port 15004 is in use",
    "something answers on localhost:15021",
    "no non-loopback local address (is_loopback is tested directly)",
]


@pytest.mark.parametrize(("want", "reason"), WANTED)
def test_the_suites_reasons_for_what_ci_provides_are_recognised(want: str, reason: str) -> None:
    assert unmet_want(reason) == want


@pytest.mark.parametrize("reason", NOT_WANTED)
def test_other_reasons_stay_skips(reason: str) -> None:
    assert unmet_want(reason) is None
