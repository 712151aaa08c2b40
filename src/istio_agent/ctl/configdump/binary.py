"""The control plane's binary config-dump sections as Envoy-style JSON, unknown ``Any`` types kept by URL.

istioctl's comparator unmarshals istiod's sections with a non-strict resolver: an ``Any`` of a type
it does not link in (Istio's own extensions: ``io.istio.http.peer_metadata.Config``,
``stats.PluginConfig``…) becomes a dynamic value and the comparison goes on. protobuf's
``MessageToDict`` instead raises on such an ``Any``, so each one is swapped for a marked stand-in
first and written back as ``{"@type": url}``, what :func:`messages.read_any` gives for an unknown
type on Envoy's side.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import any_pb2, json_format, message_factory, struct_pb2
from google.protobuf.message import Message

from istio_agent.ctl.configdump import descriptors

ANY = "google.protobuf.Any"
_STRUCT_URL = "type.googleapis.com/google.protobuf.Struct"
_MARK = "\x00istio-agent: an Any of an unknown type"


def any_to_json(resource: any_pb2.Any) -> dict[str, Any]:
    """``resource`` as protobuf JSON (lowerCamel names); raises what ``MessageToDict`` and parsing
    raise (``json_format.Error``, ``DecodeError``) for bytes that do not read as their type."""
    if descriptors.by_url(resource.type_url) is None:
        return {"@type": resource.type_url}
    copy = any_pb2.Any()
    copy.CopyFrom(resource)
    _mark(copy)
    converted = _unmark(json_format.MessageToDict(copy))
    assert isinstance(converted, dict)
    return converted


def _mark(message: Message) -> bool:
    """Replace every unknown ``Any`` under ``message`` by a marked Struct; whether anything changed."""
    if message.DESCRIPTOR.full_name == ANY:
        assert isinstance(message, any_pb2.Any)
        desc = descriptors.by_url(message.type_url)
        if desc is None:
            message.Pack(struct_pb2.Struct(fields={_MARK: struct_pb2.Value(string_value=message.type_url)}))
            return True
        inner = message_factory.GetMessageClass(desc)()
        inner.ParseFromString(message.value)
        if _mark(inner):
            message.value = inner.SerializeToString()
            return True
        return False
    changed = False
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:
            if field.message_type.fields_by_name["value"].message_type is None:
                continue
            items = list(value.values())
        elif field.is_repeated:
            items = list(value)
        else:
            items = [value]
        for item in items:
            changed = _mark(item) or changed
    return changed


def _unmark(node: Any) -> Any:
    if isinstance(node, list):
        return [_unmark(item) for item in node]
    if not isinstance(node, dict):
        return node
    inner = node.get("value")
    if node.get("@type") == _STRUCT_URL and isinstance(inner, dict) and list(inner) == [_MARK]:
        return {"@type": inner[_MARK]}
    return {key: _unmark(value) for key, value in node.items()}
