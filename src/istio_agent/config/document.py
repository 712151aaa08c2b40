"""The one way configuration documents (JSON and YAML) are read and checked.

Every document the agent takes from an operator (``PROXY_CONFIG`` and the mesh config,
``readinessProbe``, ``ISTIO_KUBE_APP_PROBERS``, ``ISTIO_PROMETHEUS_ANNOTATIONS``, the local control
plane's mesh file) is walked with :class:`Node`: each value knows where it sits in the document, so
every error names the field (``readinessProbe.httpGet.port: expected an integer, got a string``) and
no document is half applied. What differs between documents is only how keys are matched, and that
is the decoder Istio uses for each (see :class:`Keys`), not a parser of our own per document.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

from istio_agent import goformat
from istio_agent.config.env import (
    MAX_DURATION,
    Bound,
    ConfigError,
    out_of_range,
    parse_go_duration,
)

ErrorFactory = Callable[[str, str], Exception]
"""Builds the error for ``(where, problem)``: each document has its own prefix and error type."""

_WORD = re.compile(r"[A-Za-z0-9_-]+")
_DECIMAL = re.compile(r"[+-]?[0-9]+")
_MAX_SECONDS = MAX_DURATION.total_seconds()


class Keys(enum.Enum):
    """How the keys of a map are matched to field names."""

    EXACT = "exact"
    """Each field by its one name; an unknown key is an error (the mesh file)."""
    PROTOJSON = "protojson"
    """Each field by its JSON (camelCase) or proto (snake_case) name, as protojson decodes Istio's
    API messages: an unknown key is an error, and so is a field given under both names."""
    PROTOJSON_LENIENT = "protojson-lenient"
    """As PROTOJSON, but unknown keys are ignored (Istio reads ProxyConfig allowing unknown fields,
    so a newer Istio's fields do not break an older agent)."""
    GO_JSON = "go-json"
    """Go's ``encoding/json``: keys match case-insensitively, the last duplicate wins, unknown keys
    are ignored."""


class DocumentSyntaxError(ValueError):
    """The text is neither JSON nor YAML; the message is the YAML parser's, with line and column.

    The message quotes the offending line of the text. For a document holding secrets (a
    kubeconfig's token) use :attr:`brief`: the problem and its position, no text of the document.
    """

    def __init__(self, message: str, brief: str) -> None:
        super().__init__(message)
        self.brief = brief


def load_document(text: str) -> Any:
    """Parse a JSON or YAML document (JSON first: what Kubernetes and the injector write, and it spares
    an idle sidecar the YAML parser's memory); raises DocumentSyntaxError."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or "not valid YAML"
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise DocumentSyntaxError(str(err), f"{where}{problem}") from None


def config_errors(prefix: str = "") -> ErrorFactory:
    """Errors as ``ConfigError("<prefix><where>: <problem>")``, what start-up reports to the operator."""
    return lambda where, problem: ConfigError(
        f"{prefix}{where}: {problem}" if where else f"{prefix}{problem}"
    )


_KINDS = ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"), (list, "a list"))


def kind(value: object) -> str:
    """How a JSON/YAML value reads in an error message."""
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "a map"
    return next((name for type_, name in _KINDS if isinstance(value, type_)), type(value).__name__)


def _snake_case(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


@dataclass(frozen=True)
class Node:
    """One value of a document and the path that names it in errors (``tracing.zipkin.address``)."""

    value: Any
    where: str
    error: ErrorFactory

    # -- structure -------------------------------------------------------------------------------------
    @property
    def is_null(self) -> bool:
        return self.value is None

    def fail(self, problem: str) -> NoReturn:
        raise self.error(self.where, problem)

    def child(self, name: str, value: Any) -> Node:
        """A field's node: ``where.name``, or ``where["app.kubernetes.io/name"]`` for a key that is not a word."""
        if not _WORD.fullmatch(name):
            return Node(value, f'{self.where}["{name}"]', self.error)
        return Node(value, f"{self.where}.{name}" if self.where else name, self.error)

    def element(self, index: int, value: Any) -> Node:
        return Node(value, f"{self.where}[{index}]", self.error)

    def expect(self, what: str) -> NoReturn:
        self.fail(f"expected {what}, got {kind(self.value)}")

    def fields(self, names: Mapping[str, str] | Iterable[str], keys: Keys) -> Fields:
        """The map's fields, by their JSON (camelCase) names as listed in ``names``.

        For PROTOJSON each field's proto name is its snake_case spelling, unless ``names`` maps the
        JSON names to other proto names.
        """
        if not isinstance(self.value, dict):
            self.expect("a map")
        aliases = dict(names) if isinstance(names, Mapping) else {name: _snake_case(name) for name in names}
        found: dict[str, Node] = {}
        if keys is Keys.GO_JSON:
            folded = {name.lower(): name for name in aliases}
            for key, value in self.value.items():
                name = folded.get(str(key).lower())
                if name is not None:
                    found[name] = self.child(name, value)
            return Fields(self, found)
        lookup = {name: name for name in aliases}
        if keys in (Keys.PROTOJSON, Keys.PROTOJSON_LENIENT):
            lookup.update({proto: name for name, proto in aliases.items()})
        unknown = []
        for key, value in self.value.items():
            name = lookup.get(key) if isinstance(key, str) else None
            if name is None:
                unknown.append(str(key))
                continue
            if name in found:
                self.child(name, value).fail(f"set twice (as {name} and {aliases[name]})")
            found[name] = self.child(name, value)
        if unknown and keys is not Keys.PROTOJSON_LENIENT:
            if keys is Keys.EXACT:
                listed = ", ".join(f'"{key}"' for key in sorted(unknown))
                noun = "key" if len(unknown) == 1 else "keys"
                self.fail(f"unknown {noun} {listed} (known: {', '.join(aliases)})")
            self.child(unknown[0], None).fail("unknown field")
        return Fields(self, found)

    def map(self) -> dict[Any, Any]:
        """A map taken as it is (its keys and values are the caller's to check)."""
        if not isinstance(self.value, dict):
            self.expect("a map")
        return self.value

    def items(self) -> list[Node]:
        """A list's elements; null is an empty list."""
        if self.value is None:
            return []
        if not isinstance(self.value, list):
            self.expect("a list")
        return [self.element(index, value) for index, value in enumerate(self.value)]

    # -- scalars ---------------------------------------------------------------------------------------
    def string(self, default: str = "") -> str:
        """A string; null is ``default``."""
        if self.value is None:
            return default
        if not isinstance(self.value, str):
            self.expect("a string")
        return self.value

    def text(self) -> str:
        """A string that must be there (null is not one)."""
        if not isinstance(self.value, str):
            self.expect("a string")
        return self.value

    def boolean(self) -> bool:
        if not isinstance(self.value, bool):
            self.expect("true or false")
        return self.value

    def integer(
        self, *, minimum: int | None = None, maximum: int | None = None, lenient: bool = False
    ) -> int:
        """An integer within bounds. ``lenient`` takes what protojson takes for an integer field too:
        a decimal string (``"7"``) or a number without a fraction (``7.0``)."""
        value = self.value
        number: int | None = None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif lenient and isinstance(value, float) and value.is_integer():
            number = int(value)
        elif lenient and isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
            number = int(value.strip(), 10)
        if number is None:
            self.expect("an integer")
        self._check(number, minimum, maximum, str)
        return number

    def number(self, *, minimum: float | None = None, maximum: float | None = None) -> float:
        """A finite number (an integer or a decimal) within bounds."""
        value = self.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.expect("a number")
        try:
            number = float(value)
        except OverflowError:  # an integer too large for a float
            number = math.inf
        if not math.isfinite(number):
            self.fail(f"must be a finite number, got {value!r}")
        self._check(number, minimum, maximum, lambda bound: f"{bound:g}")
        return number

    def duration(self, *, minimum: timedelta | None = None, maximum: timedelta | None = None) -> timedelta:
        """A duration within bounds: Go's text (``5s``, ``1h30m``, protobuf JSON's ``1.500s``) or a
        number of seconds; never longer than Go's ``time.Duration`` holds."""
        value = self.value
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            self.expect("a duration such as 5s")
        try:
            if isinstance(value, str):
                duration = parse_go_duration(value)
            elif (isinstance(value, float) and not math.isfinite(value)) or abs(value) > _MAX_SECONDS:
                raise ValueError(f"time: invalid duration {value!r} seconds")
            else:
                duration = timedelta(seconds=value)
        except ValueError as err:
            self.fail(str(err))
        self._check(duration, minimum, maximum, goformat.duration)
        return duration

    def _check(
        self, value: Bound, minimum: Bound | None, maximum: Bound | None, show: Callable[[Bound], str]
    ) -> None:
        problem = out_of_range(value, minimum, maximum, show)
        if problem is not None:
            self.fail(f"{problem}, got {show(value)}")

    def port(self, *, lenient: bool = False) -> int:
        """A TCP/UDP port, 1 to 65535; null is "required"."""
        if self.value is None:
            self.fail("required")
        return self.integer(minimum=1, maximum=65535, lenient=lenient)

    def strings(self) -> tuple[str, ...]:
        """A list of strings; null is empty."""
        return tuple(item.text() for item in self.items())

    def string_map(self) -> dict[str, str]:
        """A ``map<string, string>``; YAML scalars (numbers, booleans) are taken as their text."""
        if not isinstance(self.value, dict):
            self.expect("a map")
        result: dict[str, str] = {}
        for key, item in self.value.items():
            if isinstance(item, dict | list) or item is None:
                self.child(str(key), item).expect("a string")
            result[str(key)] = ("true" if item else "false") if isinstance(item, bool) else str(item)
        return result

    def choice(self, options: Iterable[str], *, fold: Callable[[str], str] = str) -> str:
        """A string that must be one of ``options`` (after ``fold``, e.g. ``str.lower``)."""
        allowed = tuple(options)
        value = fold(self.string())
        if value not in allowed:
            self.fail(f"must be one of {', '.join(allowed)}, got {value!r}")
        return value


class Fields:
    """The known fields of one map. A field not given reads as null, with its path (for "required")."""

    def __init__(self, parent: Node, given: dict[str, Node]) -> None:
        self._parent = parent
        self._given = given

    def __getitem__(self, name: str) -> Node:
        node = self._given.get(name)
        return node if node is not None else self._parent.child(name, None)

    def __contains__(self, name: str) -> bool:
        """Whether the document names the field (even as null, which protojson reads as "unset")."""
        return name in self._given

    def given(self) -> list[str]:
        """The fields the document names, in document order."""
        return list(self._given)

    def set(self) -> list[str]:
        """The fields given a value other than null."""
        return [name for name, node in self._given.items() if not node.is_null]
