"""Eviction policies for the reference radix cache, behind a small registry.

Shaped like SGLang's ``mem_cache/registry.py``: ``register_eviction_policy(name, factory)``
refuses blank or duplicate names, and an unknown name fails loudly with the known ones.
Third parties add policies through the ``kvroute.eviction_policies`` entry-point group.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine_ext.cache.node import RadixNode
    from engine_ext.cache.radix import RadixCache

__all__ = [
    "EvictionPolicy",
    "EvictionPolicyFactory",
    "eviction_policy_names",
    "make_eviction_policy",
    "register_eviction_policy",
]


class EvictionPolicy(Protocol):
    """What the cache asks of a policy. The policy reads and edits the tree it was built for."""

    name: str

    def on_access(self, path: list[RadixNode]) -> None:
        """An insert went through ``path`` (root excluded, root-to-leaf order)."""

    def on_match(self, path: list[RadixNode], split: bool) -> None:
        """A match went through ``path``; ``split``: it split the last node off a longer one
        (the cache's ``marking`` says what a marking policy makes of that)."""

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` tokens where locks allow; return the number freed."""

    def reset(self) -> None:
        """The cache was flushed."""


EvictionPolicyFactory = Callable[["RadixCache", random.Random], EvictionPolicy]

_REGISTRY: dict[str, EvictionPolicyFactory] = {}
_ENTRY_POINT_GROUP = "kvroute.eviction_policies"


def register_eviction_policy(name: str, factory: EvictionPolicyFactory) -> None:
    """Add a policy under ``name``; blank or taken names are refused."""
    if not name or not name.strip():
        raise ValueError("eviction policy name must not be blank")
    if name in _REGISTRY:
        raise ValueError(f"eviction policy {name!r} is already registered")
    _REGISTRY[name] = factory


def _load_builtins_and_plugins() -> None:
    if "lru" not in _REGISTRY:
        from engine_ext.cache.lru import LRUEviction
        from engine_ext.cache.rlt import RLTEviction

        register_eviction_policy("lru", LRUEviction)
        register_eviction_policy("rlt", RLTEviction)
        for ep in entry_points(group=_ENTRY_POINT_GROUP):
            if ep.name not in _REGISTRY:
                register_eviction_policy(ep.name, ep.load())


def eviction_policy_names() -> list[str]:
    _load_builtins_and_plugins()
    return sorted(_REGISTRY)


def make_eviction_policy(name: str, cache: RadixCache, rng: random.Random) -> EvictionPolicy:
    _load_builtins_and_plugins()
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; known: {', '.join(sorted(_REGISTRY))}"
        ) from None
    return factory(cache, rng)
