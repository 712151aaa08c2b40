"""The control plane reloads its mesh file when that file changes, and only then.

Writes to other files in the same directory (a log file beside the mesh file, written every few
milliseconds) must not make it re-read the mesh; an atomic replace of the file, or the Kubernetes
ConfigMap swap of ``..data``, must give one reload.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from istio_agent.controlplane.server import ControlPlane
from istio_agent.metrics import Registry

QUIET = 0.5
"""Time for stray reloads to show up (the watcher's debounce is 50 ms)."""


def mesh_text(trust_domain: str) -> str:
    return f"trustDomain: {trust_domain}\nservices: []\n"


class Reloads:
    """Counts the control plane's mesh reloads (each a read of the file, whatever it finds)."""

    def __init__(self, plane: ControlPlane) -> None:
        self.count = 0
        self._read = plane.reload_mesh
        plane.reload_mesh = self._counted  # type: ignore[method-assign]

    async def _counted(self) -> bool:
        self.count += 1
        return await self._read()


async def started(mesh_path: Path, state: Path) -> ControlPlane:
    plane = ControlPlane(
        mesh_path, state, address="127.0.0.1:0", secure_address="127.0.0.1:0", registry=Registry()
    )
    await plane.start()
    return plane


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    (tmp_path / "mesh").mkdir()
    (tmp_path / "mesh" / "mesh.yaml").write_text(mesh_text("example.org"))
    cp = await started(tmp_path / "mesh" / "mesh.yaml", tmp_path / "state")
    try:
        yield cp
    finally:
        await cp.stop(0)


async def test_writes_beside_the_mesh_file_do_not_reload_it(plane: ControlPlane, tmp_path: Path) -> None:
    directory = tmp_path / "mesh"
    reloads = Reloads(plane)
    with (directory / "controlplane.log").open("a") as log:
        for n in range(40):
            log.write(f"line {n}\n")
            log.flush()
            await asyncio.sleep(0.01)
    other = directory / "other.yaml"
    for n in range(5):  # atomic replaces of another file in the same directory
        (directory / "other.tmp").write_text(str(n))
        os.replace(directory / "other.tmp", other)
    (directory / "scratch").mkdir()
    (directory / "scratch").rmdir()
    await asyncio.sleep(QUIET)
    assert reloads.count == 0


async def test_an_atomic_replace_of_the_mesh_file_reloads_it_once(
    plane: ControlPlane, tmp_path: Path
) -> None:
    mesh_path = tmp_path / "mesh" / "mesh.yaml"
    reloads = Reloads(plane)
    applied: asyncio.Queue[object] = asyncio.Queue()
    plane.add_mesh_listener(applied.put_nowait)
    staged = mesh_path.with_name(".mesh.yaml.tmp")
    staged.write_text(mesh_text("new.example"))
    os.replace(staged, mesh_path)
    await asyncio.wait_for(applied.get(), 5)
    await asyncio.sleep(QUIET)
    assert plane.mesh.trust_domain == "new.example"
    assert reloads.count == 1


async def test_a_configmap_update_reloads_the_mesh_file(tmp_path: Path) -> None:
    """kubelet's AtomicWriter: mesh.yaml -> ..data/mesh.yaml, ..data -> ..<timestamp> swapped by rename."""
    directory = tmp_path / "config"
    (directory / "..2026_01_01").mkdir(parents=True)
    (directory / "..2026_01_01" / "mesh.yaml").write_text(mesh_text("example.org"))
    (directory / "..data").symlink_to("..2026_01_01")
    (directory / "mesh.yaml").symlink_to("..data/mesh.yaml")
    plane = await started(directory / "mesh.yaml", tmp_path / "state")
    try:
        reloads = Reloads(plane)
        applied: asyncio.Queue[object] = asyncio.Queue()
        plane.add_mesh_listener(applied.put_nowait)
        (directory / "..2026_01_02").mkdir()
        (directory / "..2026_01_02" / "mesh.yaml").write_text(mesh_text("new.example"))
        (directory / "..data_tmp").symlink_to("..2026_01_02")
        os.replace(directory / "..data_tmp", directory / "..data")
        shutil.rmtree(directory / "..2026_01_01")
        await asyncio.wait_for(applied.get(), 5)
        await asyncio.sleep(QUIET)
        assert plane.mesh.trust_domain == "new.example"
        assert 1 <= reloads.count <= 2  # one burst; a slow machine may split it in two, never more
    finally:
        await plane.stop(0)
