"""``as_user``: a program in a directory closed to uid 1337 runs as 1337, as from a container image,
wherever the checkout lives (a clone under /root is the case it was made for); the host is left as
it was."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cni.as_user import as_user, closed_directories, outermost
from tests.cni.netns import SYSTEM_PYTHON, needs_root

PROGRAM = "import os, pathlib, sys\nprint(os.getuid(), os.getgid(), os.getgroups(), pathlib.Path(sys.argv[1]).read_text())\n"


@pytest.fixture
def closed() -> Iterator[Path]:
    """``/tmp/<dir, 0700>/inner/{program.py, data}``: the files readable by all, as in a checkout."""
    top = Path(tempfile.mkdtemp(prefix="ia-closed-", dir="/tmp"))
    try:
        inner = top / "inner"
        inner.mkdir(mode=0o755)
        (inner / "program.py").write_text(PROGRAM)
        (inner / "data").write_text("read")
        for file in inner.iterdir():
            file.chmod(0o644)
        top.chmod(0o700)
        yield top
    finally:
        shutil.rmtree(top)


def mounts_around(path: Path) -> list[str]:
    """The host's mounts on ``path``, its ancestors or below it (other tests may mount elsewhere
    meanwhile: containerd's sandboxes in a parallel worker)."""
    lines = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = Path(line.split()[4])
        if point == path or point in path.parents or path in point.parents:
            lines.append(line)
    return lines


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)


@needs_root
def test_a_program_in_a_closed_directory_runs_as_the_user_and_the_host_is_untouched(closed: Path) -> None:
    program, data = closed / "inner" / "program.py", closed / "inner" / "data"
    mounts = mounts_around(closed)
    command = [SYSTEM_PYTHON, "-I", "-S", str(program), str(data)]

    plain = run(["setpriv", "--reuid=1337", "--regid=1337", "--clear-groups", *command])
    assert plain.returncode != 0 and "Permission denied" in plain.stderr  # the problem: a closed checkout

    prefix = as_user(1337, (Path(SYSTEM_PYTHON), program, data))
    assert prefix[0] == "unshare"
    opened = run([*prefix, *command])
    assert opened.returncode == 0, opened.stderr
    assert opened.stdout == "1337 1337 [] read\n"

    assert closed.stat().st_mode & 0o777 == 0o700
    assert mounts_around(closed) == mounts


@needs_root
def test_from_a_network_namespace_as_the_tests_run_it(closed: Path) -> None:
    program, data = closed / "inner" / "program.py", closed / "inner" / "data"
    name = f"ia-{os.getpid()}-as-user"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        prefix = as_user(1337, (Path(SYSTEM_PYTHON), program))
        done = run(["ip", "netns", "exec", name, *prefix, SYSTEM_PYTHON, "-I", "-S", str(program), str(data)])
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("1337 1337 []")
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


def test_nothing_closed_is_setpriv_alone() -> None:
    top = Path(tempfile.mkdtemp(prefix="ia-open-", dir="/tmp"))
    try:
        top.chmod(0o755)
        program = top / "program.py"
        program.touch()
        assert closed_directories([program], 1337, 1337) == []
        assert as_user(1337, [program]) == ["setpriv", "--reuid=1337", "--regid=1337", "--clear-groups"]
        assert as_user(1337, [program], gid=7)[2] == "--regid=7"
    finally:
        shutil.rmtree(top)


def test_which_directories_are_closed(tmp_path: Path) -> None:
    """Search permission by owner, group and others, along the path as written and as resolved."""
    passable = tmp_path / "open"
    owner_only = passable / "owner"
    group_only = owner_only / "group"
    group_only.mkdir(parents=True)
    passable.chmod(0o711)
    owner_only.chmod(0o700)
    group_only.chmod(0o750)
    gid = group_only.stat().st_gid
    stranger = 54321
    above = closed_directories([tmp_path], stranger, stranger)  # e.g. pytest's 0700 base directory
    assert closed_directories([group_only], stranger, stranger) == [*above, str(owner_only), str(group_only)]
    assert closed_directories([group_only], stranger, gid) == [*above, str(owner_only)]  # the group passes
    owner = owner_only.stat().st_uid
    if owner != 0:  # as root: give it another owner, root passes anywhere
        assert str(owner_only) not in closed_directories([owner_only], owner, stranger)
    else:
        os.chown(owner_only, 4242, -1)
        assert str(owner_only) not in closed_directories([owner_only], 4242, stranger)
        assert closed_directories([group_only], 0, 0) == []
    (passable / "link").symlink_to(group_only)  # open as written, closed once resolved
    assert str(owner_only) in closed_directories([passable / "link"], stranger, stranger)
    (owner_only / "out").symlink_to("/usr")  # closed as written, open once resolved
    assert str(owner_only) in closed_directories([owner_only / "out"], stranger, stranger)
    assert outermost([str(group_only), str(owner_only), "/a/b", "/a"]) == ["/a", str(owner_only)]
