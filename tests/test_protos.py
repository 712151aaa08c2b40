"""The committed generated modules must match the .proto files (run ``make protos`` after editing)."""

from __future__ import annotations

import re
from pathlib import Path

from istio_agent.protos import generate

# Lines that only record which protoc / grpcio-tools produced the file.
_VERSION_LINES = re.compile(
    r"^(# Protobuf Python Version:.*|GRPC_GENERATED_VERSION = .*|\s+\d+,\s*$)", re.MULTILINE
)


def _normalise(text: str) -> str:
    return _VERSION_LINES.sub("", text)


def test_generated_modules_are_current(tmp_path: Path) -> None:
    generate.generate(tmp_path)
    fresh_dir = tmp_path / "istio_agent" / "protos"
    fresh = sorted(fresh_dir.glob("*_pb2*.py*"))
    assert fresh, "protoc produced nothing"
    for path in fresh:
        committed = generate.PROTO_DIR / path.name
        assert committed.exists(), f"{committed.name} is missing: run make protos"
        assert _normalise(committed.read_text()) == _normalise(path.read_text()), (
            f"{committed.name} is stale: run make protos"
        )


def test_wire_names_match_istio() -> None:
    from istio_agent.protos import istio_ca_pb2, nds_pb2

    service = istio_ca_pb2.DESCRIPTOR.services_by_name["IstioCertificateService"]
    assert service.full_name == "istio.v1.auth.IstioCertificateService"
    request = istio_ca_pb2.IstioCertificateRequest.DESCRIPTOR
    assert {f.name: f.number for f in request.fields} == {"csr": 1, "validity_duration": 3, "metadata": 4}
    assert istio_ca_pb2.IstioCertificateResponse.DESCRIPTOR.fields_by_name["cert_chain"].number == 1
    info = nds_pb2.NameTable.NameInfo.DESCRIPTOR
    assert nds_pb2.NameTable.DESCRIPTOR.full_name == "istio.networking.nds.v1.NameTable"
    assert {f.name: f.number for f in info.fields} == {
        "ips": 1,
        "registry": 2,
        "shortname": 3,
        "namespace": 4,
        "alt_hosts": 5,
    }


def test_health_messages_are_grpcs_on_the_wire_and_load_beside_grpcs_own() -> None:
    # grpcio-health-checking's module in the same process: no clash in protobuf's default pool.
    from grpc_health.v1 import health_pb2 as grpcs

    from istio_agent.protos import health_pb2 as ours

    for name in ("HealthCheckRequest", "HealthCheckResponse"):
        mine, theirs = getattr(ours, name).DESCRIPTOR, getattr(grpcs, name).DESCRIPTOR
        assert [(f.name, f.number, f.type) for f in mine.fields] == [
            (f.name, f.number, f.type) for f in theirs.fields
        ]
    status = ours.HealthCheckResponse.ServingStatus.DESCRIPTOR
    assert {v.name: v.number for v in status.values} == {
        v.name: v.number for v in grpcs.HealthCheckResponse.ServingStatus.DESCRIPTOR.values
    }
    request = ours.HealthCheckRequest(service="reviews").SerializeToString()
    assert request == grpcs.HealthCheckRequest(service="reviews").SerializeToString()
    answer = grpcs.HealthCheckResponse(status=grpcs.HealthCheckResponse.NOT_SERVING).SerializeToString()
    assert ours.HealthCheckResponse.FromString(answer).status == ours.HealthCheckResponse.NOT_SERVING


def test_the_generated_modules_need_no_grpcio() -> None:
    assert sorted(p.name for p in generate.PROTO_DIR.glob("*_pb2_grpc.py")) == []
