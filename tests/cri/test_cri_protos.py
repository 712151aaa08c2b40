"""The CRI subset speaks Kubernetes' wire format, and the pause image is a valid, reproducible OCI layout.

The names and numbers pinned here are those of Kubernetes' ``cri-api``
(``pkg/apis/runtime/v1/api.proto``): a wrong one would make containerd read another field or
answer "unknown service". No root and no containerd needed.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from tests.cri import pause_image, protos


def test_the_generated_modules_come_from_the_proto(tmp_path: Path) -> None:
    assert protos.stale(tmp_path)
    protos.generate(tmp_path)
    assert not protos.stale(tmp_path)
    assert "runtime.v1" in (tmp_path / "cri_runtime_pb2.py").read_text()


def test_wire_names_and_numbers_match_kubernetes() -> None:
    pb, _ = protos.load()
    service = pb.DESCRIPTOR.services_by_name["RuntimeService"]
    assert service.full_name == "runtime.v1.RuntimeService"
    assert {m.name for m in service.methods} == {
        "Version", "RunPodSandbox", "StopPodSandbox", "RemovePodSandbox", "PodSandboxStatus", "ListPodSandbox",
        "Status",
    }  # fmt: skip

    def numbers(message: Any) -> dict[str, int]:
        return {f.name: f.number for f in message.DESCRIPTOR.fields}

    assert numbers(pb.RunPodSandboxRequest) == {"config": 1, "runtime_handler": 2}
    assert numbers(pb.PodSandboxConfig) == {
        "metadata": 1, "hostname": 2, "log_directory": 3, "dns_config": 4, "labels": 6, "annotations": 7,
        "linux": 8,
    }  # fmt: skip
    assert numbers(pb.PodSandboxMetadata) == {"name": 1, "uid": 2, "namespace": 3, "attempt": 4}
    assert numbers(pb.LinuxPodSandboxConfig) == {"cgroup_parent": 1, "security_context": 2, "sysctls": 3}
    assert numbers(pb.LinuxSandboxSecurityContext) == {"namespace_options": 1, "privileged": 6}
    assert numbers(pb.NamespaceOption) == {"network": 1, "pid": 2, "ipc": 3, "target_id": 4}
    assert numbers(pb.PodSandboxStatusRequest) == {"pod_sandbox_id": 1, "verbose": 2}
    assert numbers(pb.PodSandboxStatusResponse) == {"status": 1, "info": 2}
    assert numbers(pb.PodSandboxStatus)["network"] == 5
    assert numbers(pb.PodSandboxNetworkStatus) == {"ip": 1, "additional_ips": 2}
    assert numbers(pb.StatusResponse) == {"status": 1, "info": 2}
    assert (pb.POD, pb.CONTAINER, pb.NODE, pb.TARGET) == (0, 1, 2, 3)
    assert (pb.SANDBOX_READY, pb.SANDBOX_NOTREADY) == (0, 1)


@pytest.fixture
def busybox(tmp_path: Path) -> Path:
    """A stand-in for the static busybox (its bytes do not matter to the layout)."""
    fake = tmp_path / "busybox"
    fake.write_bytes(b"\x7fELF not really busybox")
    return fake


def test_the_pause_image_is_an_oci_layout_whose_digests_hold(tmp_path: Path, busybox: Path) -> None:
    archive = tmp_path / "pause.tar"
    assert pause_image.build(archive, name="localhost/t/pause:1", busybox=busybox) == "localhost/t/pause:1"
    with tarfile.open(archive) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    for name, data in files.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rpartition("/")[2]
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    (entry,) = json.loads(files["index.json"])["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == "localhost/t/pause:1"
    manifest = json.loads(files[f"blobs/sha256/{entry['digest'].removeprefix('sha256:')}"])
    config = json.loads(files[f"blobs/sha256/{manifest['config']['digest'].removeprefix('sha256:')}"])
    assert config["config"]["Entrypoint"] == ["/pause"]
    (layer,) = manifest["layers"]
    assert config["rootfs"]["diff_ids"] == [layer["digest"]]
    layer_tar = files[f"blobs/sha256/{layer['digest'].removeprefix('sha256:')}"]
    with tarfile.open(fileobj=io.BytesIO(layer_tar)) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["pause"].mode == 0o755 and members["bin/busybox"].mode == 0o755
    assert members["bin/sh"].linkname == "busybox" and members["bin/sleep"].linkname == "busybox"


def test_two_builds_give_the_same_bytes(tmp_path: Path, busybox: Path) -> None:
    first, second = tmp_path / "1.tar", tmp_path / "2.tar"
    pause_image.build(first, busybox=busybox)
    pause_image.build(second, busybox=busybox)
    assert first.read_bytes() == second.read_bytes()


def test_without_busybox_static_the_error_says_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="busybox-static"):
        pause_image.build(tmp_path / "x.tar", busybox=tmp_path / "missing")
