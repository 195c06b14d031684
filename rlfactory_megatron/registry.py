"""Name -> implementation registries: one per pluggable kind (losses, estimators, engines, transports, ...)."""
from collections.abc import Iterator
from typing import Generic, TypeVar

F = TypeVar("F")


class Registry(Generic[F]):
    """Implementations of one kind (e.g. advantage estimators), looked up by the name a config gives."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str, fn: F | None = None):
        """Register `fn` under `name`; without `fn`, return a decorator that does."""
        if fn is not None:
            self._add(name, fn)
            return fn

        def decorator(f: F) -> F:
            self._add(name, f)
            return f

        return decorator

    def _add(self, name: str, fn: F) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} '{name}' is already registered")
        self._entries[name] = fn

    def get(self, name: str) -> F:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} '{name}'; choose one of: {', '.join(sorted(self._entries))}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> Iterator[tuple[str, F]]:
        return iter(self._entries.items())
