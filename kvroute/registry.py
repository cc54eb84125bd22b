"""One small registry for every pluggable kind: routing policies, residual models, evictions.

Shaped like SGLang's ``mem_cache/registry.py``: ``register`` refuses blank or duplicate
names, ``get`` an unknown one with the names that are known. The built-ins are registered on
first use, then third parties' factories from an entry-point group; a name registered before
the first use (a plugin, a test) does not hide the built-ins.

>>> shapes = Registry("shape", "example.shapes", lambda r: r.register("square", str))
>>> shapes.register("circle", repr)
>>> shapes.names()
['circle', 'square']
>>> shapes.get("hexagon")
Traceback (most recent call last):
...
ValueError: unknown shape 'hexagon'; known: circle, square
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Generic, TypeVar

__all__ = ["Registry"]

F = TypeVar("F")


class Registry(Generic[F]):
    """Named factories of one kind (``what``: "policy", "model kind", "eviction policy")."""

    def __init__(
        self, what: str, entry_point_group: str, builtins: Callable[[Registry[F]], None]
    ) -> None:
        self.what = what
        self.entry_point_group = entry_point_group
        self._builtins = builtins
        self._factories: dict[str, F] = {}
        self._loaded = False  # built-ins and entry points in (not "the registry is non-empty")

    def register(self, name: str, factory: F) -> None:
        """Add ``factory`` under ``name``; blank or taken names are refused."""
        self._load()
        if not name or not name.strip():
            raise ValueError(f"{self.what} name must not be blank")
        if name in self._factories:
            raise ValueError(f"{self.what} {name!r} is already registered")
        self._factories[name] = factory

    def names(self) -> list[str]:
        self._load()
        return sorted(self._factories)

    def get(self, name: str) -> F:
        """The factory registered as ``name``; ValueError naming the known ones otherwise."""
        self._load()
        factory = self._factories.get(name)
        if factory is None:
            known = ", ".join(sorted(self._factories))
            raise ValueError(f"unknown {self.what} {name!r}; known: {known}")
        return factory

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True  # first: the built-ins come back through register
        self._builtins(self)
        for ep in entry_points(group=self.entry_point_group):
            if ep.name not in self._factories:
                self._factories[ep.name] = ep.load()
