"""Ambient enablement selectors: which pods are ambient, from their labels and their namespace's.

Istio's ``cni/pkg/util/enablement_selector.go``: ``AMBIENT_ENABLEMENT_SELECTOR`` (install-cni) and the
plugin config's ``enablement_selectors`` hold a list of ``{podSelector, namespaceSelector}``, each a
Kubernetes ``LabelSelector``; a pod is ambient when it has no ``sidecar.istio.io/status`` annotation
and some entry's pod selector matches its labels and the same entry's namespace selector its
namespace's (an empty or absent selector matches everything). The plugin and the node agent both
decide with this one module. NamedTuples, not dataclasses: the plugin imports it on every ambient
ADD (docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

SIDECAR_STATUS = "sidecar.istio.io/status"
DATAPLANE_MODE = "istio.io/dataplane-mode"
_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


class SelectorError(ValueError):
    """A selector Kubernetes' ``LabelSelectorAsSelector`` would refuse."""


class Requirement(NamedTuple):
    key: str
    operator: str  # In, NotIn, Exists, DoesNotExist
    values: frozenset[str]

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "Exists":
            return self.key in labels
        if self.operator == "DoesNotExist":
            return self.key not in labels
        if self.operator == "In":
            return self.key in labels and labels[self.key] in self.values
        return self.key not in labels or labels[self.key] not in self.values  # NotIn


class LabelSelector(NamedTuple):
    """A compiled ``LabelSelector``: every requirement must hold (none: everything matches)."""

    requirements: tuple[Requirement, ...]

    @property
    def empty(self) -> bool:
        return not self.requirements

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(requirement.matches(labels) for requirement in self.requirements)


class EnablementSelector(NamedTuple):
    pod: LabelSelector
    namespace: LabelSelector


def compile_selectors(
    raw: Sequence[Mapping[str, Any]], where: str = "enablement selector"
) -> tuple[EnablementSelector, ...]:
    """The selectors of ``raw`` (decoded YAML or JSON); SelectorError naming ``where`` and the entry."""
    compiled = []
    for index, entry in enumerate(raw):
        if not isinstance(entry, Mapping):
            raise SelectorError(f"{where}[{index}]: expected an object")
        pod = _label_selector(entry.get("podSelector"), f"{where}[{index}].podSelector")
        namespace = _label_selector(entry.get("namespaceSelector"), f"{where}[{index}].namespaceSelector")
        compiled.append(EnablementSelector(pod, namespace))
    return tuple(compiled)


def pod_is_ambient(
    selectors: Sequence[EnablementSelector],
    pod_labels: Mapping[str, str],
    pod_annotations: Mapping[str, str],
    namespace_labels: Mapping[str, str],
) -> bool:
    """Istio's ``CompiledEnablementSelectors.Matches``: a sidecar pod never is."""
    if SIDECAR_STATUS in pod_annotations:
        return False
    return any(s.pod.matches(pod_labels) and s.namespace.matches(namespace_labels) for s in selectors)


def namespace_selected(selectors: Sequence[EnablementSelector], namespace_labels: Mapping[str, str]) -> bool:
    """Istio's ``MatchesNamespace``: some entry's non-empty namespace selector matches."""
    return any(not s.namespace.empty and s.namespace.matches(namespace_labels) for s in selectors)


def labels_of(obj: Mapping[str, Any], what: str = "labels") -> dict[str, str]:
    """``metadata.labels`` (or ``annotations``) of an API object, {} when absent."""
    meta = obj.get("metadata")
    found = meta.get(what) if isinstance(meta, Mapping) else None
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, Mapping) else {}


def _label_selector(raw: Any, where: str) -> LabelSelector:
    if raw is None:
        return LabelSelector(())
    if not isinstance(raw, Mapping):
        raise SelectorError(f"{where}: expected an object")
    requirements = []
    match_labels = raw.get("matchLabels") or {}
    if not isinstance(match_labels, Mapping):
        raise SelectorError(f"{where}.matchLabels: expected an object")
    for key, value in match_labels.items():
        if not isinstance(value, str):
            raise SelectorError(f"{where}.matchLabels[{key}]: expected a string")
        requirements.append(Requirement(str(key), "In", frozenset({value})))
    expressions = raw.get("matchExpressions") or []
    if not isinstance(expressions, list):
        raise SelectorError(f"{where}.matchExpressions: expected a list")
    for index, expression in enumerate(expressions):
        requirements.append(_requirement(expression, f"{where}.matchExpressions[{index}]"))
    return LabelSelector(tuple(requirements))


def _requirement(raw: Any, where: str) -> Requirement:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("key"), str):
        raise SelectorError(f"{where}: expected an object with a key")
    operator, values = raw.get("operator"), raw.get("values") or []
    if operator not in _OPERATORS:
        raise SelectorError(f'{where}: "{operator}" is not a valid label selector operator')
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise SelectorError(f"{where}.values: expected a list of strings")
    if operator in ("In", "NotIn") and not values:
        raise SelectorError(f"{where}.values: for 'in', 'notin' operators, values set can't be empty")
    if operator in ("Exists", "DoesNotExist") and values:
        raise SelectorError(f"{where}.values: values set must be empty for exists and does not exist")
    return Requirement(raw["key"], operator, frozenset(values))
