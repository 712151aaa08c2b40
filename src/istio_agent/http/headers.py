"""HTTP header fields: ordered, multi-valued, looked up without regard to case, spelled as received.

Names keep their case because what a probe forwards must reach the application as kubelet sent it.
Values are text decoded as Latin-1, so any byte sequence survives a round trip through the agent.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import overload

Fields = Iterable[tuple[str, str]] | Mapping[str, str]


def encode_text(text: str) -> bytes:
    """Latin-1 when possible (lossless for received fields), else UTF-8."""
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        return text.encode("utf-8")


class Headers:
    """A list of ``(name, value)`` pairs with case-insensitive lookups."""

    __slots__ = ("_items",)

    def __init__(self, fields: Fields | None = None) -> None:
        self._items: list[tuple[str, str]] = []
        if fields is not None:
            pairs = fields.items() if isinstance(fields, Mapping) else fields
            self._items.extend((str(name), str(value)) for name, value in pairs)

    @classmethod
    def from_raw(cls, raw: Iterable[tuple[bytes, bytes]]) -> Headers:
        headers = cls()
        headers._items = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in raw]
        return headers

    def raw(self) -> list[tuple[bytes, bytes]]:
        return [(encode_text(name), encode_text(value)) for name, value in self._items]

    @overload
    def get(self, name: str) -> str | None: ...

    @overload
    def get(self, name: str, default: str) -> str: ...

    @overload
    def get(self, name: str, default: str | None) -> str | None: ...

    def get(self, name: str, default: str | None = None) -> str | None:
        """The first value of ``name``."""
        lower = name.lower()
        return next((value for key, value in self._items if key.lower() == lower), default)

    def getall(self, name: str) -> list[str]:
        lower = name.lower()
        return [value for key, value in self._items if key.lower() == lower]

    def __getitem__(self, name: str) -> str:
        value = self.get(name)
        if value is None:
            raise KeyError(name)
        return value

    def __setitem__(self, name: str, value: str) -> None:
        """Replace every ``name`` field by one (where the first one was, else at the end)."""
        lower = name.lower()
        for index, (key, _) in enumerate(self._items):
            if key.lower() == lower:
                self._items[index] = (name, value)
                self._items[index + 1 :] = [
                    item for item in self._items[index + 1 :] if item[0].lower() != lower
                ]
                return
        self._items.append((name, value))

    def setdefault(self, name: str, value: str) -> str:
        current = self.get(name)
        if current is None:
            self._items.append((name, value))
            return value
        return current

    def add(self, name: str, value: str) -> None:
        self._items.append((name, value))

    def pop(self, name: str, default: str | None = None) -> str | None:
        """Remove every ``name`` field; the first value, or ``default``."""
        first = self.get(name, default)
        lower = name.lower()
        self._items = [item for item in self._items if item[0].lower() != lower]
        return first

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)
        self.pop(name)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        lower = name.lower()
        return any(key.lower() == lower for key, _ in self._items)

    def items(self) -> list[tuple[str, str]]:
        return list(self._items)

    def copy(self) -> Headers:
        return Headers(self._items)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Headers) and self._items == other._items

    def __repr__(self) -> str:
        return f"Headers({self._items!r})"
