"""ZDS, the node agent's hand-off of pod network namespaces to ztunnel (Istio's
``cni/pkg/nodeagent/ztunnelserver*.go``; cases after ``ztunnelserver_linux_test.go``).

The wire contract is checked against Istio's own ``pkg/zdsapi/zds.proto`` (``golden/ambient/zds``).
The behaviour tests run the server against the ztunnel stand-in (``ztunnel_standin.py``) with real
network namespaces: the stand-in receives each pod's netns fd by ``SCM_RIGHTS`` and opens ztunnel's
listeners inside it, so a test checks the hand-off by connecting to them from inside the pod.
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import descriptor_pb2

from istio_agent.protos import zds_pb2
from tests.cni.istio_sources import drifted

GOLDEN = Path(__file__).parents[1] / "golden" / "ambient" / "zds"


def _istios_descriptor(tmp_path: Path) -> descriptor_pb2.FileDescriptorProto:
    """Istio's zds.proto compiled to a descriptor (never loaded into protobuf's default pool)."""
    from grpc_tools import protoc

    out = tmp_path / "istio-zds.pb"
    assert protoc.main(["protoc", f"-I{GOLDEN}", f"--descriptor_set_out={out}", "zds.proto"]) == 0
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (istios,) = files.file
    return istios


def _shape(proto: descriptor_pb2.FileDescriptorProto) -> dict[str, object]:
    """What the wire depends on: package, enums and their values, messages with fields and oneofs."""
    messages = {}
    for message in proto.message_type:
        fields = {
            f.name: (
                f.number,
                f.type,
                f.label,
                f.type_name,
                f.oneof_index if f.HasField("oneof_index") else None,
            )
            for f in message.field
        }
        messages[message.name] = {
            "fields": fields,
            "oneofs": [o.name for o in message.oneof_decl],
            "reserved": sorted((r.start, r.end) for r in message.reserved_range),
            "reserved_names": sorted(message.reserved_name),
        }
    enums = {e.name: {v.name: v.number for v in e.value} for e in proto.enum_type}
    return {"package": proto.package, "syntax": proto.syntax, "messages": messages, "enums": enums}


def test_the_golden_is_istios_zds_proto() -> None:
    assert drifted(GOLDEN) == {}


def test_our_zds_proto_is_istios_wire_contract(tmp_path: Path) -> None:
    ours = descriptor_pb2.FileDescriptorProto()
    zds_pb2.DESCRIPTOR.CopyToProto(ours)
    assert _shape(ours) == _shape(_istios_descriptor(tmp_path))
    assert zds_pb2.WorkloadRequest.DESCRIPTOR.full_name == "istio.workload.zds.WorkloadRequest"
