"""Namespaces that let repeated blocks reuse skip names."""
from __future__ import annotations

import uuid
from typing import Any

__all__ = ["Namespace", "DEFAULT"]


class Namespace:
    """A namespace for skip names: ``block.isolate(Namespace())`` keeps its names apart from others.

    Equal across processes (compared by a UUID), so skip routes hold on every stage worker: one object
    sent to them, not one made on each (a stage factory's own, or one its module makes on import).
    """

    __slots__ = ("id",)

    def __init__(self, _id: str | None = None) -> None:
        self.id = _id or uuid.uuid4().hex

    def __repr__(self) -> str:
        return "Namespace(default)" if self.id == "default" else f"Namespace({self.id[:8]})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Namespace) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __lt__(self, other: Namespace) -> bool:  # skip keys sort, as torch's namespaces did
        return self.id < other.id

    def __reduce__(self) -> tuple[Any, ...]:
        return Namespace, (self.id,)


#: The namespace of every skip name not isolated explicitly.
DEFAULT = Namespace("default")
