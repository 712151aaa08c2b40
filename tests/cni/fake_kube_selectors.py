"""Label and field selectors, and label validation, as the real Kubernetes API server reads them.

For the FAKE API server (``fake_kube.py``): a stand-in must refuse what the real one refuses, so a
selector the real server answers with 400 is a 400 here too. Written from the Kubernetes API's rules
(``k8s.io/apimachinery/pkg/labels/selector.go`` and ``pkg/fields/selector.go``, the pod fields of
``pkg/registry/core/pod/strategy.go``), not from the controller under test.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_SPECIAL = ("!=", "==", "!", "(", ")", ",", "=", ">", "<")
POD_FIELDS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "metadata.name": lambda pod: (pod.get("metadata") or {}).get("name", ""),
    "metadata.namespace": lambda pod: (pod.get("metadata") or {}).get("namespace", ""),
    "spec.nodeName": lambda pod: (pod.get("spec") or {}).get("nodeName", ""),
    "spec.restartPolicy": lambda pod: (pod.get("spec") or {}).get("restartPolicy", ""),
    "spec.schedulerName": lambda pod: (pod.get("spec") or {}).get("schedulerName", ""),
    "spec.serviceAccountName": lambda pod: (pod.get("spec") or {}).get("serviceAccountName", ""),
    "spec.hostNetwork": lambda pod: "true" if (pod.get("spec") or {}).get("hostNetwork") else "false",
    "status.phase": lambda pod: (pod.get("status") or {}).get("phase", ""),
    "status.podIP": lambda pod: ((pod.get("status") or {}).get("podIPs") or [{}])[0].get("ip", ""),
    "status.nominatedNodeName": lambda pod: (pod.get("status") or {}).get("nominatedNodeName", ""),
}
"""The pod fields the API server can select on (anything else: ``field label not supported``)."""


class SelectorError(ValueError):
    """The API server answers this selector with 400 Bad Request; the message is its reason."""


def qualified_name_problem(key: str) -> str | None:
    """Why ``key`` is not a valid label or annotation key (``[prefix/]name``), or None."""
    prefix, _, name = key.rpartition("/")
    if "/" in key and not prefix:
        return "prefix part must be non-empty"
    if prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix)):
        return "prefix part must be a lowercase RFC 1123 subdomain"
    if not name:
        return "name part must be non-empty"
    if len(name) > 63:
        return "name part must be no more than 63 characters"
    if not _NAME.fullmatch(name):
        return (
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
            "with an alphanumeric character"
        )
    return None


def label_value_problem(value: str) -> str | None:
    """Why ``value`` is not a valid label value, or None."""
    if value == "":
        return None
    if len(value) > 63:
        return "must be no more than 63 characters"
    if not _NAME.fullmatch(value):
        return (
            "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
            "and must start and end with an alphanumeric character"
        )
    return None


def dns_subdomain_problem(name: str) -> str | None:
    """Why ``name`` is not an RFC 1123 subdomain (object names), or None."""
    if len(name) > 253:
        return "must be no more than 253 characters"
    if not _DNS1123_SUBDOMAIN.fullmatch(name):
        return (
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
            "and must start and end with an alphanumeric character"
        )
    return None


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # exists, !, =, !=, in, notin, >, <
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op in ("=", "in"):
            return present and value in self.values
        if self.op in ("!=", "notin"):
            return not present or value not in self.values
        if not present or not re.fullmatch(r"-?\d+", value or ""):
            return False
        number, bound = int(value or "0"), int(self.values[0])
        return number > bound if self.op == ">" else number < bound


def _tokens(text: str) -> list[str]:
    out, i = [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        special = next((s for s in _SPECIAL if text.startswith(s, i)), None)
        if special is not None:
            out.append(special)
            i += len(special)
            continue
        start = i
        while i < len(text) and not text[i].isspace() and not any(text.startswith(s, i) for s in _SPECIAL):
            i += 1
        out.append(text[start:i])
    return out


def parse_label_selector(text: str) -> tuple[Requirement, ...]:
    """A label selector (``a=b,c in (d,e),!f``); SelectorError as the API server words it."""
    tokens = _tokens(text)
    if not tokens:
        return ()
    requirements = []
    i = 0

    def take() -> str:
        nonlocal i
        if i >= len(tokens):
            raise SelectorError("unable to parse requirement: found '', expected: identifier")
        i += 1
        return tokens[i - 1]

    def identifier(what: str) -> str:
        token = take()
        if token in _SPECIAL:
            raise SelectorError(f"unable to parse requirement: found '{token}', expected: {what}")
        return token

    while True:
        negated = tokens[i] == "!"
        if negated:
            i += 1
        key = identifier("identifier")
        problem = qualified_name_problem(key)
        if problem:
            raise SelectorError(f'unable to parse requirement: Invalid value: "{key}": {problem}')
        if negated:
            requirement = Requirement(key, "!")
        elif i >= len(tokens) or tokens[i] == ",":
            requirement = Requirement(key, "exists")
        else:
            op = take()
            if op in ("=", "==", "!="):
                value = "" if i >= len(tokens) or tokens[i] == "," else identifier("identifier")
                values: tuple[str, ...] = (value,)
                op = "=" if op == "==" else op
            elif op in ("in", "notin"):
                if take() != "(":
                    raise SelectorError("unable to parse requirement: found '', expected: '('")
                collected: list[str] = []
                while True:
                    token = take()
                    if token == ")":
                        break
                    if token == ",":
                        continue
                    if token in _SPECIAL:
                        raise SelectorError(
                            f"unable to parse requirement: found '{token}', expected: ',', ')'"
                        )
                    collected.append(token)
                if not collected:
                    raise SelectorError(
                        "unable to parse requirement: for 'in', 'notin' operators, values set can't be empty"
                    )
                values = tuple(collected)
            elif op in (">", "<"):
                value = identifier("identifier")
                if not re.fullmatch(r"-?\d+", value):
                    raise SelectorError(
                        f"unable to parse requirement: for 'Gt', 'Lt' operators, the value must be an integer: {value}"
                    )
                values = (value,)
            else:
                raise SelectorError(
                    f"unable to parse requirement: found '{op}', expected: in, notin, =, ==, !=, gt, lt"
                )
            if op not in (">", "<"):
                for value in values:
                    problem = label_value_problem(value)
                    if problem:
                        raise SelectorError(
                            f'unable to parse requirement: Invalid value: "{value}": {problem}'
                        )
            requirement = Requirement(key, op, values)
        requirements.append(requirement)
        if i >= len(tokens):
            return tuple(requirements)
        if tokens[i] != ",":
            raise SelectorError(f"found '{tokens[i]}', expected: ',' or 'end of string'")
        i += 1
        if i >= len(tokens):
            raise SelectorError("found '', expected: identifier")


def _split_unescaped(text: str, separator: str) -> list[str]:
    parts, current, i = [], [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            current.append(text[i : i + 2])
            i += 2
            continue
        if text[i] == separator:
            parts.append("".join(current))
            current = []
        else:
            current.append(text[i])
        i += 1
    parts.append("".join(current))
    return parts


def _unescape(value: str, whole: str) -> str:
    out, i = [], 0
    while i < len(value):
        if value[i] == "\\":
            if i + 1 >= len(value) or value[i + 1] not in "\\,=":
                raise SelectorError(f"invalid field selector: '{whole}'; invalid escape sequence")
            out.append(value[i + 1])
            i += 2
            continue
        if value[i] in ",=":
            raise SelectorError(f"invalid field selector: '{whole}'; unescaped {value[i]!r}")
        out.append(value[i])
        i += 1
    return "".join(out)


def parse_field_selector(
    text: str, fields: Mapping[str, Any] = POD_FIELDS
) -> tuple[tuple[str, str, str], ...]:
    """A field selector (``spec.nodeName=n1,metadata.namespace!=x``) as ``(field, op, value)``;
    only the resource's selectable fields are accepted."""
    if not text.strip():
        return ()
    terms = []
    for term in _split_unescaped(text, ","):
        for op in ("!=", "==", "="):
            index = term.find(op)
            if index >= 0:
                break
        else:
            raise SelectorError(f"invalid selector: '{text}'; can't understand '{term}'")
        field, value = term[:index], _unescape(term[index + len(op) :], text)
        if field not in fields:
            raise SelectorError(f"field label not supported: {field}")
        terms.append((field, "!=" if op == "!=" else "=", value))
    return tuple(terms)


def fields_match(terms: tuple[tuple[str, str, str], ...], pod: Mapping[str, Any]) -> bool:
    return all((POD_FIELDS[field](pod) == value) == (op == "=") for field, op, value in terms)


def labels_match(requirements: tuple[Requirement, ...], pod: Mapping[str, Any]) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return all(requirement.matches(labels) for requirement in requirements)
