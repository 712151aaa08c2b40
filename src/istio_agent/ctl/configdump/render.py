"""The Go printers istioctl's config-dump views end in: tabwriter, ``json.MarshalIndent``, JSONToYAML.

* Tables: Go's ``text/tabwriter`` (``goformat.tabwrite``) with the padding of each writer; a line
  whose last cell is empty keeps the padding of the cell before it, as Go writes it.
* JSON: ``json.MarshalIndent(proto.MessageSlice, "", "    ")`` re-indents jsonpb's text, HTML-safe.
* YAML: ``sigs.k8s.io/yaml.JSONToYAML`` (go-yaml v2): keys in go-yaml's order (digit runs compared as
  numbers, letters after other characters), strings that YAML would read as something else in
  double quotes, numbers as Go formats them, lines folded at 80 columns (PyYAML's emitter shares
  libyaml's rules with go-yaml's).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from functools import cmp_to_key
from typing import Any

import yaml

from istio_agent.ctl.configdump.messages import plain
from istio_agent.ctl.configdump.source import read_json
from istio_agent.goformat import json_marshal


def message_slice_json(nodes: Sequence[Any]) -> str:
    """istioctl's ``json.MarshalIndent(MessageSlice, "", "    ")`` (no final newline)."""
    return json_marshal([plain(node) for node in nodes], "    ")


def protojson_text(node: Any) -> str:
    """protojson ``Multiline, Indent "    "``, spaced as ``encoding/json`` writes it (no HTML escaping)."""
    text = json_marshal(plain(node), "    ")
    return _HTML_ESCAPE.sub(lambda m: m.group(1) + _HTML_CHARS[m.group(2)], text)


_HTML_CHARS = {"003c": "<", "003e": ">", "0026": "&"}
_HTML_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\u(003c|003e|0026)")


# -- YAML ------------------------------------------------------------------------------------------------
def json_to_yaml(text: str) -> str:
    """``sigs.k8s.io/yaml.JSONToYAML`` of JSON text (ends with a newline, as go-yaml's); ValueError
    for text that is not JSON."""
    value = read_json(text)
    if value is None:
        return "null\n"
    return yaml.dump(
        _Ordered(value), Dumper=_GoDumper, allow_unicode=True, default_flow_style=False, width=80
    )


class _Ordered:
    """A decoded JSON value, to be represented by :class:`_GoDumper`."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class _GoDumper(yaml.SafeDumper):
    """No implicit resolvers: every scalar's style is chosen here as go-yaml chooses it."""

    yaml_implicit_resolvers: dict[str, Any] = {}


def _represent(dumper: _GoDumper, data: _Ordered) -> yaml.Node:
    return _node(dumper, data.value)


def _node(dumper: _GoDumper, value: Any) -> yaml.Node:
    if isinstance(value, dict):
        keys = sorted(value, key=cmp_to_key(_key_compare))
        pairs = [(_string(dumper, key), _node(dumper, value[key])) for key in keys]
        return yaml.MappingNode("tag:yaml.org,2002:map", pairs, flow_style=not pairs)
    if isinstance(value, list):
        items = [_node(dumper, item) for item in value]
        return yaml.SequenceNode("tag:yaml.org,2002:seq", items, flow_style=not items)
    if isinstance(value, str):
        return _string(dumper, value)
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, int):
        text = str(value)
    else:
        text = go_g(value)
    return yaml.ScalarNode("tag:yaml.org,2002:str", text, style=None)


def _string(dumper: _GoDumper, text: str) -> yaml.Node:
    if "\n" in text:
        style: str | None = "|"
    elif resolves_to_other(text):
        style = '"'
    else:
        style = None
    return yaml.ScalarNode("tag:yaml.org,2002:str", text, style=style)


_GoDumper.add_representer(_Ordered, _represent)

_RESOLVE_MAP = {
    *("", "~", "null", "Null", "NULL"),
    *("y", "Y", "yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON"),
    *("n", "N", "no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF"),
    *(".nan", ".NaN", ".NAN"),
    *(".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF", "-.inf", "-.Inf", "-.INF"),
    "<<",
}
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_BASE60 = re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?")
_TIMESTAMPS = (
    re.compile(r"\d{4}-\d{1,2}-\d{1,2}"),
    re.compile(r"\d{4}-\d{1,2}-\d{1,2}[Tt]\d{1,2}:\d{1,2}:\d{1,2}(\.\d+)?(Z|[+-]\d\d:\d\d)"),
    re.compile(r"\d{4}-\d{1,2}-\d{1,2} \d{1,2}:\d{1,2}:\d{1,2}(\.\d+)?"),
)
_GO_INT = re.compile(r"[-+]?(0[xX][0-9a-fA-F]+|0[bB][01]+|0[oO][0-7]+|0[0-7]*|[1-9][0-9]*)")


def resolves_to_other(text: str) -> bool:
    """Whether go-yaml v2 would read ``text`` unquoted as something else than this string."""
    if text in _RESOLVE_MAP or _BASE60.fullmatch(text):
        return True
    if not text or text[0] not in "+-0123456789.":
        return False
    if text[0] == ".":
        return _FLOAT.fullmatch(text) is not None
    if any(pattern.fullmatch(text) for pattern in _TIMESTAMPS):
        return True
    bare = text.replace("_", "")
    return bool(_GO_INT.fullmatch(bare) or _FLOAT.fullmatch(bare) or re.fullmatch(r"-?0b[01]+", bare))


def go_g(value: float) -> str:
    """Go's ``strconv.FormatFloat(value, 'g', -1, 64)``, with go-yaml's names for infinities and NaN."""
    if math.isnan(value):
        return ".nan"
    if math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    if value == 0:
        return "-0" if math.copysign(1, value) < 0 else "0"
    sign = "-" if value < 0 else ""
    text = repr(abs(value))
    if "e" in text:
        coefficient, _, power = text.partition("e")
        exp = int(power)
        raw_digits = coefficient.replace(".", "")
        point = 1 + exp
    else:
        whole, _, fraction = text.partition(".")
        fraction = fraction.rstrip("0")
        raw_digits = (whole + fraction).lstrip("0")
        point = len(whole) if whole != "0" else -(len(fraction) - len(fraction.lstrip("0")))
    raw_digits = raw_digits.rstrip("0") or "0"
    exp = point - 1
    if exp < -4 or exp >= 6:
        head, tail = raw_digits[0], raw_digits[1:]
        return f"{sign}{head}{'.' + tail if tail else ''}e{'-' if exp < 0 else '+'}{abs(exp):02d}"
    if point <= 0:
        return f"{sign}0.{'0' * -point}{raw_digits}"
    if point >= len(raw_digits):
        return sign + raw_digits + "0" * (point - len(raw_digits))
    return f"{sign}{raw_digits[:point]}.{raw_digits[point:]}"


def _key_compare(a: str, b: str) -> int:
    """go-yaml v2's key order (``keyList.Less``) for string keys, as -1/0/1."""
    if a == b:
        return 0
    return -1 if _key_less(a, b) else 1


def _key_less(a: str, b: str) -> bool:
    """Runs of decimal digits (any script's, ``unicode.IsDigit``) compare by value, each digit
    counted as its code point minus ``'0'`` in int64 arithmetic, as go-yaml does."""
    for i in range(min(len(a), len(b))):
        ca, cb = a[i], b[i]
        if ca == cb:
            continue
        la, lb = ca.isalpha(), cb.isalpha()
        if la and lb:
            return ca < cb
        if la or lb:
            return lb
        an = bn = 0
        if ca == "0" or cb == "0":
            j = i - 1
            while j >= 0 and a[j].isdecimal():
                if a[j] != "0":
                    an = bn = 1
                    break
                j -= 1
        ai = i
        while ai < len(a) and a[ai].isdecimal():
            an = _int64(an * 10 + ord(a[ai]) - 48)
            ai += 1
        bi = i
        while bi < len(b) and b[bi].isdecimal():
            bn = _int64(bn * 10 + ord(b[bi]) - 48)
            bi += 1
        if an != bn:
            return an < bn
        if ai != bi:
            return ai < bi
        return ca < cb
    return len(a) < len(b)


def _int64(value: int) -> int:
    """Go's int64 wrap-around."""
    return (value + 2**63) % 2**64 - 2**63
