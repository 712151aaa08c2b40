"""Envoy's JSON of a message, read as Go reads it into a proto and written back as jsonpb writes it.

istioctl unmarshals the dump (protojson, unknown fields dropped), then prints resources with
golang/protobuf's jsonpb (``pkg/util/protomarshal``): fields in declaration order under their JSON
(lowerCamel) names, zero scalars left out, 64-bit integers as strings, enums by name, an ``Any``
with ``@type`` first, and the well-known types in their JSON forms (``"1.500s"``, ``"…Z"``).
:func:`read` gives that as Python values (``Msg`` for a message, ``MapV`` for a map field, and
``StructV``/``ListV``/``ValueV`` for ``google.protobuf.Struct``/``ListValue``/``Value``, whose
indentation jsonpb writes differently); :func:`plain` drops the markers; :func:`jsonpb_text` is
jsonpb's own indented text (``protomarshal.ToJSONWithIndent``, quirks included).

An ``Any`` whose type this process does not know (Istio's own extensions) keeps its content as
Envoy wrote it. istioctl resolves types non-strictly: an unknown one becomes a dynamic value and
the view goes on; keeping Envoy's JSON goes on likewise and keeps the dump readable.
"""

from __future__ import annotations

import base64
import binascii
import calendar
import math
import re
import struct
from decimal import Decimal
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from istio_agent.ctl.configdump import descriptors
from istio_agent.goformat import go_float, json_marshal


class Msg(dict[str, Any]):
    """A message: its set fields, in declaration order, by JSON name (an Any's ``@type`` first)."""


class AnyWkt(dict[str, Any]):
    """An Any holding a well-known type: ``{"@type": …, "value": …}``."""


class MapV(dict[str, Any]):
    """A map field, keys in jsonpb's order."""


class StructV(dict[str, Any]):
    """A ``google.protobuf.Struct``: keys sorted, values ``ValueV``."""


class ListV(list[Any]):
    """A ``google.protobuf.ListValue``: items ``ValueV``."""


class ValueV:
    """A ``google.protobuf.Value``: None, a float, a string, a bool, a StructV or a ListV."""

    __slots__ = ("inner",)

    def __init__(self, inner: Any) -> None:
        self.inner = inner


class MessageError(ValueError):
    """A value that does not fit its field (what Go's unmarshalling rejects)."""


WRAPPERS = {
    "google.protobuf.DoubleValue",
    "google.protobuf.FloatValue",
    "google.protobuf.Int64Value",
    "google.protobuf.UInt64Value",
    "google.protobuf.Int32Value",
    "google.protobuf.UInt32Value",
    "google.protobuf.BoolValue",
    "google.protobuf.StringValue",
    "google.protobuf.BytesValue",
}
SPECIAL = WRAPPERS | {
    "google.protobuf.Any",
    "google.protobuf.Duration",
    "google.protobuf.Timestamp",
    "google.protobuf.Struct",
    "google.protobuf.Value",
    "google.protobuf.ListValue",
    "google.protobuf.FieldMask",
}
"""Types with a JSON form of their own: in an Any they sit under ``value`` (Empty is not one)."""

_INT64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}
_INT32 = {
    FieldDescriptor.TYPE_INT32,
    FieldDescriptor.TYPE_UINT32,
    FieldDescriptor.TYPE_SINT32,
    FieldDescriptor.TYPE_FIXED32,
    FieldDescriptor.TYPE_SFIXED32,
}


# -- reading ---------------------------------------------------------------------------------------------
def read(desc: Descriptor, raw: Any) -> Any:
    """``raw`` (Envoy's JSON of a ``desc`` message) as jsonpb would print it, in marked Python values."""
    name = desc.full_name
    if name in SPECIAL or name == "google.protobuf.Empty":
        return _special(name, raw)
    if not isinstance(raw, dict):
        raise MessageError(f"{name}: expected an object, got {_kind(raw)}")
    out = Msg()
    for field in desc.fields:
        value = raw.get(field.name)
        if value is None:
            value = raw.get(field.json_name)
        if value is None and not _is_value(field):
            continue
        converted = _field(field, value)
        if converted is not _UNSET:
            out[field.json_name] = converted
    return out


def read_any(raw: Any) -> Any:
    """An ``Any`` (``{"@type": …, …}``) as jsonpb prints it; ``{}`` is an empty Any."""
    if raw == {}:
        return Msg()
    if not isinstance(raw, dict) or not isinstance(raw.get("@type"), str):
        raise MessageError('an Any without "@type"')
    url = raw["@type"]
    desc = descriptors.by_url(url)
    if desc is None:
        unknown = Msg({"@type": url})
        unknown.update((k, v) for k, v in raw.items() if k != "@type")
        return unknown
    if desc.full_name in SPECIAL:
        return AnyWkt({"@type": url, "value": _special(desc.full_name, raw.get("value"))})
    body = read(desc, {k: v for k, v in raw.items() if k != "@type"})
    out = Msg({"@type": url})
    out.update(body)
    return out


_UNSET = object()


def _is_value(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.full_name == "google.protobuf.Value"


def _is_map(field: FieldDescriptor) -> bool:
    return field.is_repeated and field.message_type is not None and field.message_type.GetOptions().map_entry


def _field(field: FieldDescriptor, value: Any) -> Any:
    if _is_map(field):
        if not isinstance(value, dict):
            raise MessageError(f"{field.full_name}: expected an object")
        key_field = field.message_type.fields_by_name["key"]
        value_field = field.message_type.fields_by_name["value"]
        entries = [(_map_key(key_field, k), v) for k, v in value.items()]
        entries.sort(key=lambda entry: entry[0])
        out = MapV()
        for key, item in entries:
            converted = _single(value_field, item)
            out[_key_text(key)] = converted if converted is not _UNSET else _zero(value_field)
        return out if out else _UNSET
    if field.is_repeated:
        if not isinstance(value, list):
            raise MessageError(f"{field.full_name}: expected a list")
        items = [_single(field, item) for item in value]
        items = [_zero(field) if item is _UNSET else item for item in items]
        return items if items else _UNSET
    converted = _single(field, value)
    if converted is _UNSET:
        return _UNSET
    if field.message_type is None and not _present(field) and _is_zero(field, converted):
        return _UNSET
    return converted


def _present(field: FieldDescriptor) -> bool:
    """Whether a zero value is still printed: a oneof member or a proto3 ``optional``."""
    return field.containing_oneof is not None or bool(getattr(field, "has_presence", False))


def _is_zero(field: FieldDescriptor, value: Any) -> bool:
    if field.enum_type is not None:  # read as its name when known: zero is the number 0
        known = field.enum_type.values_by_name.get(value) if isinstance(value, str) else None
        return (known.number if known is not None else value) == 0
    return value in (0, "", False, "0") and not (isinstance(value, float) and math.copysign(1, value) < 0)


def _zero(field: FieldDescriptor) -> Any:
    if field.message_type is not None:
        return read(field.message_type, {})
    if field.enum_type is not None:
        return field.enum_type.values_by_number[0].name if 0 in field.enum_type.values_by_number else 0
    return _scalar(field, 0 if field.type != FieldDescriptor.TYPE_STRING else "")


def _map_key(field: FieldDescriptor, key: str) -> Any:
    """A map key as protojson reads it: ``true``/``false``, or decimal digits (``strconv.ParseInt``)
    in the key type's range."""
    if field.type == FieldDescriptor.TYPE_BOOL:
        if key not in ("true", "false"):
            raise MessageError(f"{field.full_name}: invalid value for bool key: {key!r}")
        return key == "true"
    if field.type in _INT64 or field.type in _INT32:
        low, high = _RANGES[field.type]
        number = int(key) if re.fullmatch(r"[+-]?[0-9]{1,25}", key) else None
        if number is None or not low <= number <= high:
            raise MessageError(f"{field.full_name}: invalid value for integer key: {key!r}")
        return number
    return key


def _key_text(key: Any) -> str:
    if isinstance(key, bool):
        return "true" if key else "false"
    return str(key)


def _single(field: FieldDescriptor, value: Any) -> Any:
    if field.message_type is not None:
        if value is None and not _is_value(field):
            return _UNSET
        if field.message_type.full_name == "google.protobuf.Any":
            return read_any(value)
        return read(field.message_type, value)
    if value is None:
        return _UNSET
    if field.enum_type is not None:
        if field.enum_type.full_name == "google.protobuf.NullValue":
            return None
        return _enum(field, value)
    return _scalar(field, value)


def _enum(field: FieldDescriptor, value: Any) -> Any:
    enum = field.enum_type
    if isinstance(value, str):
        if value in enum.values_by_name:
            return value
        raise MessageError(f"{field.full_name}: invalid value for enum {enum.full_name}: {value}")
    if isinstance(value, int) and not isinstance(value, bool):
        known = enum.values_by_number.get(value)
        return known.name if known is not None else value
    raise MessageError(f"{field.full_name}: invalid value for enum {enum.full_name}: {value!r}")


def _scalar(field: FieldDescriptor, value: Any) -> Any:
    kind = field.type
    try:
        if kind in _INT64:
            return str(_integer(value, kind))
        if kind in _INT32:
            return _integer(value, kind)
        if kind == FieldDescriptor.TYPE_DOUBLE:
            return _float(value)
        if kind == FieldDescriptor.TYPE_FLOAT:
            return float32(_float(value))
        if kind == FieldDescriptor.TYPE_BOOL:
            if not isinstance(value, bool):
                raise ValueError("not a bool")
            return value
        if kind == FieldDescriptor.TYPE_STRING:
            if not isinstance(value, str):
                raise ValueError("not a string")
            return value
        if kind == FieldDescriptor.TYPE_BYTES:
            return _bytes(value)
    except (ValueError, TypeError, ArithmeticError) as err:
        raise MessageError(f"{field.full_name}: {value!r}: {err}") from None
    raise MessageError(f"{field.full_name}: unsupported field type {kind}")


_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
"""What protojson accepts for each integer type (a value outside is an error, not wrapped)."""
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def _integer(value: Any, kind: int = FieldDescriptor.TYPE_INT64) -> int:
    """A JSON number, or a string holding one, that is a whole number in the field's range
    (protojson: ``1e3`` and ``"2.0"`` are read, ``" 1"``, ``"0x1"`` and overflow are not)."""
    low, high = _RANGES[kind]
    if isinstance(value, bool):
        raise ValueError("not an integer")
    if isinstance(value, int):
        number = value
    elif isinstance(value, float):
        if not value.is_integer():
            raise ValueError("not an integer")
        number = int(value)
    elif isinstance(value, str) and _JSON_NUMBER.fullmatch(value):
        decimal = Decimal(value)
        if decimal.adjusted() > 20:  # beyond every range: never build the huge integer
            raise ValueError("out of range")
        if decimal != decimal.to_integral_value():
            raise ValueError("not an integer")
        number = int(decimal)
    else:
        raise ValueError("not an integer")
    if not low <= number <= high:
        raise ValueError("out of range")
    return number


def _float(value: Any) -> float:
    """A JSON number, or a string holding one or ``NaN``/``Infinity``/``-Infinity``; what overflows
    float64 is an error (Go's ``ParseFloat`` range error), not an infinity."""
    if isinstance(value, bool):
        raise ValueError("not a number")
    if isinstance(value, str):
        special = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
        if value in special:
            return special[value]
        if not _JSON_NUMBER.fullmatch(value):
            raise ValueError("not a number")
        number = float(value)
    elif isinstance(value, (int, float)):
        number = float(value)
    else:
        raise ValueError("not a number")
    if not math.isfinite(number):
        raise ValueError("out of range")
    return number


def float32(value: float) -> float:
    """A float32 field's value as Go prints it: the shortest decimal that reads back as that float32."""
    if not math.isfinite(value):
        return value
    single = struct.unpack("<f", struct.pack("<f", value))[0]
    for digits in range(1, 10):
        text = f"{single:.{digits}g}"
        if struct.unpack("<f", struct.pack("<f", float(text)))[0] == single:
            return float(text)
    return single


def _bytes(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("not base64")
    text = value.replace("-", "+").replace("_", "/")
    text += "=" * (-len(text) % 4)
    try:
        return base64.b64encode(base64.b64decode(text, validate=True)).decode()
    except binascii.Error as err:
        raise ValueError(f"not base64 ({err})") from None


def _special(name: str, raw: Any) -> Any:
    try:
        if name == "google.protobuf.Any":
            return read_any(raw)
        if name == "google.protobuf.Struct":
            if not isinstance(raw, dict):
                raise ValueError("not an object")
            return StructV((key, _value(raw[key])) for key in sorted(raw))
        if name == "google.protobuf.ListValue":
            if not isinstance(raw, list):
                raise ValueError("not a list")
            return ListV(_value(item) for item in raw)
        if name == "google.protobuf.Value":
            return _value(raw)
        if name == "google.protobuf.Duration":
            return duration(raw)
        if name == "google.protobuf.Timestamp":
            return timestamp(raw)
        if name == "google.protobuf.FieldMask":
            if not isinstance(raw, str):
                raise ValueError("not a string")
            return raw
        if name == "google.protobuf.Empty":
            return Msg()
        wrapped = descriptors.message(name)
        assert wrapped is not None
        return _scalar(wrapped.fields_by_name["value"], raw)
    except (ValueError, TypeError, ArithmeticError) as err:
        raise MessageError(f"{name}: {raw!r}: {err}") from None


def _value(raw: Any) -> ValueV:
    if isinstance(raw, dict):
        return ValueV(StructV((key, _value(raw[key])) for key in sorted(raw)))
    if isinstance(raw, list):
        return ValueV(ListV(_value(item) for item in raw))
    if isinstance(raw, bool) or raw is None or isinstance(raw, str):
        return ValueV(raw)
    if isinstance(raw, (int, float)):
        return ValueV(float(raw))
    raise ValueError(f"not a JSON value: {raw!r}")


_DURATION = re.compile(r"(-)?(\d+)(?:\.(\d{1,9}))?s")
_TIMESTAMP = re.compile(
    r"(\d{4})-(\d\d)-(\d\d)[Tt](\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?(?:[Zz]|([+-])(\d\d):(\d\d))"
)


def _trim(text: str) -> str:
    """jsonpb's 0, 3, 6 or 9 fractional digits of ``…%09d``."""
    for suffix in ("000", "000", ".000"):
        text = text.removesuffix(suffix)
    return text


def duration(raw: Any) -> str:
    """A Duration's JSON (``"1.500s"``), from Envoy's."""
    if not isinstance(raw, str) or not (match := _DURATION.fullmatch(raw)):
        raise ValueError("not a duration")
    sign, seconds, fraction = match.group(1) or "", int(match.group(2)), (match.group(3) or "").ljust(9, "0")
    if seconds == 0 and int(fraction) == 0:
        sign = ""
    return _trim(f"{sign}{seconds}.{fraction}") + "s"


def timestamp(raw: Any) -> str:
    """A Timestamp's JSON (UTC, ``Z``, 0/3/6/9 fractional digits), from RFC 3339 text."""
    if not isinstance(raw, str) or not (match := _TIMESTAMP.fullmatch(raw)):
        raise ValueError("not an RFC 3339 timestamp")
    year, month, day, hour, minute, second = (int(match.group(i)) for i in range(1, 7))
    fraction = (match.group(7) or "").ljust(9, "0")
    seconds = calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0))
    if match.group(8):
        offset = int(match.group(9)) * 3600 + int(match.group(10)) * 60
        seconds -= offset if match.group(8) == "+" else -offset
    import time

    moment = time.gmtime(seconds)
    text = time.strftime("%Y-%m-%dT%H:%M:%S", moment) + "." + fraction
    return _trim(text) + "Z"


def _kind(raw: Any) -> str:
    return type(raw).__name__


# -- writing ---------------------------------------------------------------------------------------------
def plain(node: Any) -> Any:
    """The value without markers: what ``encoding/json`` re-indents and YAML is made from."""
    if isinstance(node, ValueV):
        return plain(node.inner)
    if isinstance(node, dict):
        return {key: plain(value) for key, value in node.items()}
    if isinstance(node, list):
        return [plain(item) for item in node]
    if isinstance(node, float) and not math.isfinite(node):
        return "NaN" if math.isnan(node) else "Infinity" if node > 0 else "-Infinity"
    return node


def scalar_text(value: Any) -> str:
    """A scalar as jsonpb writes it (Go's ``json.Marshal``; NaN and infinities as strings)."""
    if isinstance(value, float):
        if math.isnan(value):
            return '"NaN"'
        if math.isinf(value):
            return '"Infinity"' if value > 0 else '"-Infinity"'
        return go_float(value)
    return json_marshal(value)


def jsonpb_text(node: Any, indent: str = "    ") -> str:
    """jsonpb's ``Marshaler{Indent: indent}`` text of a message read by :func:`read`."""
    return _message(node, "", indent)


def _message(node: Any, level: str, step: str) -> str:
    if isinstance(node, ValueV):
        return _singular(node.inner, level, step)
    if isinstance(node, (StructV, ListV)):
        return _container(node, level, step)
    if isinstance(node, AnyWkt):
        return (
            "{\n" + level + step + '"@type": ' + scalar_text(node["@type"]) + ",\n"
            f'{level}{step}"value": ' + _message(node["value"], level + step, step) + "\n" + level + "}"
        )
    if isinstance(node, dict):
        fields = [
            f"{level}{step}{json_marshal(key)}: " + _field_value(value, level, step)
            for key, value in node.items()
        ]
        return "{\n" + ",\n".join(fields) + "\n" + level + "}"
    return scalar_text(node)


def _field_value(value: Any, level: str, step: str) -> str:
    if isinstance(value, (MapV, list)) and not isinstance(value, ListV):
        return _container(value, level, step)
    return _singular(value, level, step)


def _singular(value: Any, level: str, step: str) -> str:
    if isinstance(value, (dict, list, ValueV)):
        return _message(value, level + step, step)
    return scalar_text(value)


def _container(value: dict[str, Any] | list[Any], level: str, step: str) -> str:
    inner = "\n" + level + step + step
    if isinstance(value, dict):
        items = [
            f"{json_marshal(key)}: " + _singular(item, level + step, step) for key, item in value.items()
        ]
        return "{" + ",".join(inner + item for item in items) + "\n" + level + step + "}"
    items = [_singular(item, level + step, step) for item in value]
    return "[" + ",".join(inner + item for item in items) + "\n" + level + step + "]"
