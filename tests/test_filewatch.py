"""FileWatcher against real files: atomic replaces, key-only changes, symlinks, Kubernetes rotation."""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import shutil
import threading
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from istio_agent.filewatch import FileWatcher, trace_links
from istio_agent.inotify import DIRECTORY_CHANGES, Inotify
from istio_agent.metrics import Registry

CALL_TIMEOUT = 3.0
QUIET = 0.5


class Recorder:
    """Collects callback calls; lets a test await the n-th one or check that none came."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._changed = asyncio.Event()
        self.fail_first = False

    def __call__(self, resource: str) -> None:
        self.calls.append(resource)
        self._changed.set()
        if self.fail_first and len(self.calls) == 1:
            raise RuntimeError("callback exploded")

    def count(self, resource: str) -> int:
        return self.calls.count(resource)

    async def wait_for(self, resource: str, n: int) -> None:
        async def reached() -> None:
            while self.count(resource) < n:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(reached(), CALL_TIMEOUT)

    async def settle(self) -> None:
        """Give stray (wrong) extra calls the time to show up."""
        await asyncio.sleep(QUIET)


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
async def watcher(recorder: Recorder) -> AsyncIterator[FileWatcher]:
    w = FileWatcher(recorder, debounce=timedelta(milliseconds=50), registry=Registry())
    await w.start()
    yield w
    await w.stop()


def write(path: Path, text: str) -> None:
    path.write_text(text)


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def make_pair(directory: Path) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "cert-chain.pem", directory / "key.pem"
    write(cert, "cert v1")
    write(key, "key v1")
    return cert, key


async def test_write_in_place_gives_one_call(
    tmp_path: Path, watcher: FileWatcher, recorder: Recorder
) -> None:
    cert, key = make_pair(tmp_path)
    watcher.watch("default", [cert, key])
    write(cert, "cert v2")
    await recorder.wait_for("default", 1)
    await recorder.settle()
    assert recorder.calls == ["default"]


async def test_atomic_replace_gives_exactly_one_call(
    tmp_path: Path, watcher: FileWatcher, recorder: Recorder
) -> None:
    cert, key = make_pair(tmp_path)
    watcher.watch("default", [cert, key])
    for round_ in (1, 2):
        atomic_write(cert, f"cert v{round_ + 1}")
        await recorder.wait_for("default", round_)
        await recorder.settle()
        assert recorder.calls == ["default"] * round_


async def test_key_only_replace_gives_one_call(
    tmp_path: Path, watcher: FileWatcher, recorder: Recorder
) -> None:
    """Istio misses this; a new key without a new cert is still a changed secret."""
    cert, key = make_pair(tmp_path)
    watcher.watch("default", [cert, key])
    atomic_write(key, "key v2")
    await recorder.wait_for("default", 1)
    await recorder.settle()
    assert recorder.calls == ["default"]


async def test_unrelated_file_in_same_directory_gives_no_call(
    tmp_path: Path, watcher: FileWatcher, recorder: Recorder
) -> None:
    cert, key = make_pair(tmp_path)
    watcher.watch("default", [cert, key])
    write(tmp_path / "other.pem", "unrelated")
    atomic_write(tmp_path / "another.pem", "unrelated")
    (tmp_path / "other.pem").unlink()
    await recorder.settle()
    assert recorder.calls == []
    # The watch is live: a real change right after is reported.
    write(cert, "cert v2")
    await recorder.wait_for("default", 1)


async def test_delete_and_recreate_keeps_watching(
    tmp_path: Path, watcher: FileWatcher, recorder: Recorder
) -> None:
    root = tmp_path / "root-cert.pem"
    write(root, "root v1")
    watcher.watch("ROOTCA", [root])
    root.unlink()
    await recorder.wait_for("ROOTCA", 1)
    write(root, "root v2")
    await recorder.wait_for("ROOTCA", 2)
    await recorder.settle()
    seen = recorder.count("ROOTCA")
    write(root, "root v3")
    await recorder.wait_for("ROOTCA", seen + 1)


async def test_resources_get_independent_calls(
    tmp_path: Path, watcher: FileWatcher, recorder: Recorder
) -> None:
    cert, key = make_pair(tmp_path / "workload")
    root = tmp_path / "roots" / "root-cert.pem"
    root.parent.mkdir()
    write(root, "root v1")
    watcher.watch("default", [cert, key])
    watcher.watch("ROOTCA", [root])
    atomic_write(root, "root v2")
    await recorder.wait_for("ROOTCA", 1)
    await recorder.settle()
    assert recorder.calls == ["ROOTCA"]
    atomic_write(cert, "cert v2")
    await recorder.wait_for("default", 1)
    await recorder.settle()
    assert recorder.calls == ["ROOTCA", "default"]


async def test_change_just_before_a_new_watch_is_not_lost(
    tmp_path: Path, watcher: FileWatcher, recorder: Recorder
) -> None:
    """A new directory re-opens the OS watch; what the old one had buffered is handed over."""
    cert, key = make_pair(tmp_path / "workload")
    root = tmp_path / "roots" / "root-cert.pem"
    root.parent.mkdir()
    write(root, "root v1")
    watcher.watch("default", [cert, key])
    atomic_write(cert, "cert v2")
    watcher.watch("ROOTCA", [root])  # no await in between: the change is still buffered
    await recorder.wait_for("default", 1)
    await recorder.settle()
    assert recorder.calls == ["default"]
    # Again while the OS watch is busy waiting in its thread (it went back to it after the call).
    other = tmp_path / "others" / "other.pem"
    other.parent.mkdir()
    write(other, "other")
    atomic_write(key, "key v2")
    watcher.watch("other", [other])
    await recorder.wait_for("default", 2)
    await recorder.settle()
    assert recorder.calls == ["default", "default"]


async def test_events_spread_over_a_burst_give_one_call(tmp_path: Path, recorder: Recorder) -> None:
    cert, key = make_pair(tmp_path)
    w = FileWatcher(recorder, debounce=timedelta(seconds=1), registry=Registry())
    await w.start()
    try:
        w.watch("default", [cert, key])
        atomic_write(cert, "cert v2")
        await asyncio.sleep(0.2)  # long enough for separate OS batches, well inside the debounce
        atomic_write(key, "key v2")
        await asyncio.sleep(0.2)
        write(cert, "cert v3")
        await recorder.wait_for("default", 1)
        await recorder.settle()
        assert recorder.calls == ["default"]
    finally:
        await w.stop()


async def test_same_file_for_two_resources_calls_each(
    tmp_path: Path, watcher: FileWatcher, recorder: Recorder
) -> None:
    root = tmp_path / "root-cert.pem"
    write(root, "root v1")
    watcher.watch("ROOTCA", [root])
    watcher.watch(f"file-root:{root}", [root])
    atomic_write(root, "root v2")
    await recorder.wait_for("ROOTCA", 1)
    await recorder.wait_for(f"file-root:{root}", 1)
    await recorder.settle()
    assert sorted(recorder.calls) == sorted(["ROOTCA", f"file-root:{root}"])


def make_secret_volume(volume: Path, version: str) -> None:
    """Lay out a volume the way kubelet's AtomicWriter does."""
    volume.mkdir()
    data = volume / f"..{version}"
    data.mkdir()
    write(data / "cert.pem", f"cert {version}")
    write(data / "key.pem", f"key {version}")
    os.symlink(data.name, volume / "..data")
    for name in ("cert.pem", "key.pem"):
        os.symlink(f"..data/{name}", volume / name)


def rotate_secret_volume(volume: Path, old: str, new: str) -> None:
    data = volume / f"..{new}"
    data.mkdir()
    write(data / "cert.pem", f"cert {new}")
    write(data / "key.pem", f"key {new}")
    os.symlink(data.name, volume / "..data_tmp")
    os.replace(volume / "..data_tmp", volume / "..data")
    shutil.rmtree(volume / f"..{old}")


async def test_kubernetes_secret_rotation_gives_one_call_each(
    tmp_path: Path, watcher: FileWatcher, recorder: Recorder
) -> None:
    volume = tmp_path / "secret"
    make_secret_volume(volume, "2026_01_01")
    watcher.watch("default", [volume / "cert.pem", volume / "key.pem"])
    versions = ["2026_01_01", "2026_02_01", "2026_03_01", "2026_04_01"]
    for n, (old, new) in enumerate(itertools.pairwise(versions), start=1):
        rotate_secret_volume(volume, old, new)
        await recorder.wait_for("default", n)
        await recorder.settle()
        assert recorder.calls == ["default"] * n
        assert (volume / "cert.pem").read_text() == f"cert {new}"


@pytest.mark.parametrize("alt_dir", ["real", "elsewhere"])
async def test_symlink_target_change_and_retarget(
    tmp_path: Path, watcher: FileWatcher, recorder: Recorder, alt_dir: str
) -> None:
    real = tmp_path / "real"
    real.mkdir()
    write(real / "root-cert.pem", "root v1")
    (tmp_path / alt_dir).mkdir(exist_ok=True)
    alt = tmp_path / alt_dir / "root-alt.pem"
    write(alt, "root alt")
    link_dir = tmp_path / "mounted"
    link_dir.mkdir()
    link = link_dir / "root-cert.pem"
    os.symlink(real / "root-cert.pem", link)
    watcher.watch("ROOTCA", [link])

    atomic_write(real / "root-cert.pem", "root v2")  # the target, in another directory
    await recorder.wait_for("ROOTCA", 1)
    await recorder.settle()
    assert recorder.calls == ["ROOTCA"]

    tmp_link = link_dir / "tmp-link"
    os.symlink(alt, tmp_link)
    os.replace(tmp_link, link)  # the link itself now points elsewhere
    await recorder.wait_for("ROOTCA", 2)
    await recorder.settle()
    assert recorder.calls == ["ROOTCA"] * 2

    write(real / "root-cert.pem", "old target, no longer ours")
    await recorder.settle()
    assert recorder.calls == ["ROOTCA"] * 2
    write(alt, "root alt v2")  # the new target is watched
    await recorder.wait_for("ROOTCA", 3)


async def test_data_link_created_in_symlinked_file_directory(
    tmp_path: Path, watcher: FileWatcher, recorder: Recorder
) -> None:
    target = tmp_path / "store" / "cert.pem"
    target.parent.mkdir()
    write(target, "cert")
    volume = tmp_path / "volume"
    volume.mkdir()
    os.symlink(target, volume / "cert.pem")
    watcher.watch("default", [volume / "cert.pem"])
    os.symlink("store", volume / "..data")
    await recorder.wait_for("default", 1)


async def test_relative_path_is_watched_as_absolute(
    tmp_path: Path, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "cert.pem", "cert v1")
    w = FileWatcher(recorder, debounce=timedelta(milliseconds=50), registry=Registry())
    w.watch("default", [Path("cert.pem")])  # before start is fine
    w.watch("default", [Path("./cert.pem"), tmp_path / "cert.pem"])
    assert w.watched_paths("default") == {tmp_path / "cert.pem"}
    await w.start()
    try:
        monkeypatch.chdir(tmp_path.parent)  # the watch does not follow the working directory
        atomic_write(tmp_path / "cert.pem", "cert v2")
        await recorder.wait_for("default", 1)
        await recorder.settle()
        assert recorder.calls == ["default"]
    finally:
        await w.stop()


async def test_unwatch_stops_calls(tmp_path: Path, watcher: FileWatcher, recorder: Recorder) -> None:
    cert, key = make_pair(tmp_path)
    watcher.watch("default", [cert, key])
    watcher.unwatch("default")
    watcher.unwatch("never-watched")
    assert watcher.watched_paths("default") == set()
    atomic_write(cert, "cert v2")
    await recorder.settle()
    assert recorder.calls == []


async def test_directory_removed_and_recreated_resumes(
    tmp_path: Path, watcher: FileWatcher, recorder: Recorder
) -> None:
    directory = tmp_path / "certs"
    cert, key = make_pair(directory)
    watcher.watch("default", [cert, key])
    shutil.rmtree(directory)
    await recorder.wait_for("default", 1)
    await recorder.settle()
    make_pair(directory)
    await recorder.wait_for("default", 2)
    await recorder.settle()
    seen = recorder.count("default")
    atomic_write(key, "key v3")
    await recorder.wait_for("default", seen + 1)


async def test_directory_replaced_within_one_batch_resumes(
    tmp_path: Path, watcher: FileWatcher, recorder: Recorder
) -> None:
    """Remove and recreate the directory at once: the new directory (a new inode) is watched."""
    directory = tmp_path / "certs"
    cert, key = make_pair(directory)
    watcher.watch("default", [cert, key])
    shutil.rmtree(directory)
    make_pair(directory)
    await recorder.wait_for("default", 1)
    await recorder.settle()
    seen = recorder.count("default")
    atomic_write(cert, "cert v3")
    await recorder.wait_for("default", seen + 1)


async def test_missing_directory_is_picked_up_when_created(
    tmp_path: Path, watcher: FileWatcher, recorder: Recorder
) -> None:
    cert = tmp_path / "later" / "deeper" / "cert.pem"
    watcher.watch("default", [cert])
    cert.parent.mkdir(parents=True)
    await recorder.wait_for("default", 1)
    await recorder.settle()
    seen = recorder.count("default")
    write(cert, "cert v1")
    await recorder.wait_for("default", seen + 1)


async def test_failing_callback_does_not_stop_later_calls(
    tmp_path: Path, watcher: FileWatcher, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    recorder.fail_first = True
    cert, key = make_pair(tmp_path)
    watcher.watch("default", [cert, key])
    with caplog.at_level(logging.ERROR, logger="istio.cache"):
        atomic_write(cert, "cert v2")
        await recorder.wait_for("default", 1)
    assert any("callback for default failed" in r.getMessage() for r in caplog.records)
    await recorder.settle()
    atomic_write(cert, "cert v3")
    await recorder.wait_for("default", 2)


async def test_stop_leaves_nothing_running(tmp_path: Path, recorder: Recorder) -> None:
    cert, key = make_pair(tmp_path)
    w = FileWatcher(recorder, debounce=timedelta(milliseconds=50), registry=Registry())
    await w.start()
    w.watch("default", [cert, key])
    write(cert, "cert v2")  # a pending call is dropped by stop()
    await w.stop()
    await w.stop()  # idempotent
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
    assert not [t for t in threading.enumerate() if t.name.startswith("istio-file-watch")]
    await asyncio.sleep(0.2)
    assert recorder.calls == []


async def test_restart_after_stop(tmp_path: Path, recorder: Recorder) -> None:
    cert, key = make_pair(tmp_path)
    w = FileWatcher(recorder, debounce=timedelta(milliseconds=50), registry=Registry())
    w.watch("default", [cert, key])
    await w.start()
    await w.stop()
    await w.start()
    try:
        atomic_write(cert, "cert v2")
        await recorder.wait_for("default", 1)
    finally:
        await w.stop()


async def test_unwatchable_directory_is_counted(tmp_path: Path, recorder: Recorder) -> None:
    if os.geteuid() == 0:
        pytest.skip("root can watch any directory")
    locked = tmp_path / "locked"
    cert, _ = make_pair(locked)
    locked.chmod(0o000)
    registry = Registry()
    w = FileWatcher(recorder, debounce=timedelta(milliseconds=50), registry=registry)
    await w.start()
    try:
        w.watch("default", [cert])
        assert (registry.sample("istio_agent_num_file_watcher_failures") or 0) > 0
    finally:
        await w.stop()
        locked.chmod(0o700)


async def test_failed_watch_is_counted_and_retried(
    tmp_path: Path, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An add-watch failure (e.g. inotify limits) spares other directories and is retried."""
    good_cert, _ = make_pair(tmp_path / "good")
    bad_cert, _ = make_pair(tmp_path / "bad")
    blocked = {tmp_path / "bad"}
    recovered = asyncio.Event()
    real_add_watch = Inotify.add_watch

    def flaky_add_watch(self: Inotify, directory: Path, mask: int = DIRECTORY_CHANGES) -> int:
        if directory in blocked:
            raise OSError(errno.ENOSPC, "inotify watch limit reached", str(directory))
        if directory == tmp_path / "bad":
            recovered.set()
        return real_add_watch(self, directory, mask)

    monkeypatch.setattr(Inotify, "add_watch", flaky_add_watch)
    registry = Registry()
    w = FileWatcher(recorder, debounce=timedelta(milliseconds=50), registry=registry)
    await w.start()
    try:
        w.watch("good", [good_cert])
        w.watch("bad", [bad_cert])
        assert registry.sample("istio_agent_num_file_watcher_failures") == 1
        atomic_write(good_cert, "cert v2")
        await recorder.wait_for("good", 1)
        blocked.clear()
        await asyncio.wait_for(recovered.wait(), CALL_TIMEOUT)
        atomic_write(bad_cert, "cert v2")
        await recorder.wait_for("bad", 1)
        await recorder.settle()
        assert sorted(recorder.calls) == ["bad", "good"]
    finally:
        await w.stop()


def test_negative_debounce_is_rejected(recorder: Recorder) -> None:
    with pytest.raises(ValueError, match="debounce"):
        FileWatcher(recorder, debounce=timedelta(milliseconds=-1), registry=Registry())


class TestTraceLinks:
    def test_regular_file(self, tmp_path: Path) -> None:
        write(tmp_path / "f", "x")
        assert trace_links(tmp_path / "f") == (tmp_path / "f", set())

    def test_link_at_end_and_in_middle(self, tmp_path: Path) -> None:
        (tmp_path / "b-alt").mkdir()
        write(tmp_path / "b-alt" / "f", "x")
        os.symlink("b-alt", tmp_path / "b")
        os.symlink("b/f", tmp_path / "f-link")
        final, links = trace_links(tmp_path / "f-link")
        assert final == tmp_path / "b-alt" / "f"
        assert links == {tmp_path / "f-link", tmp_path / "b"}

    def test_absolute_target_and_broken_link(self, tmp_path: Path) -> None:
        os.symlink(tmp_path / "missing" / "f", tmp_path / "broken")
        final, links = trace_links(tmp_path / "broken")
        assert final == tmp_path / "missing" / "f"
        assert links == {tmp_path / "broken"}

    def test_loop_terminates(self, tmp_path: Path) -> None:
        os.symlink("b", tmp_path / "a")
        os.symlink("a", tmp_path / "b")
        _, links = trace_links(tmp_path / "a")
        assert links == {tmp_path / "a", tmp_path / "b"}


async def test_nothing_watched_holds_no_inotify_instance(recorder: Recorder) -> None:
    w = FileWatcher(recorder, registry=Registry())
    await w.start()
    try:
        assert w._inotify is None  # instances are limited per user; an agent with no files holds none
    finally:
        await w.stop()


async def test_no_inotify_instance_left_is_counted_and_retried(
    tmp_path: Path, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fs.inotify.max_user_instances reached (every sidecar of a node is uid 1337): start still works."""
    cert, _ = make_pair(tmp_path)
    real_init = Inotify.__init__
    limit_reached = True

    def init(self: Inotify) -> None:
        if limit_reached:
            raise OSError(errno.EMFILE, "inotify_init1: Too many open files")
        real_init(self)

    monkeypatch.setattr(Inotify, "__init__", init)
    registry = Registry()
    w = FileWatcher(recorder, debounce=timedelta(milliseconds=50), registry=registry)
    await w.start()
    try:
        w.watch("default", [cert])
        assert registry.sample("istio_agent_num_file_watcher_failures") == 1
        limit_reached = False
        await asyncio.sleep(0.3)  # the first retry comes after 0.1 s
        atomic_write(cert, "cert v2")
        await recorder.wait_for("default", 1)
    finally:
        await w.stop()
