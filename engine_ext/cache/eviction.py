"""Eviction policies for the reference radix cache, behind a small registry.

Shaped like SGLang's ``mem_cache/registry.py``: ``register_eviction_policy(name, factory)``
refuses blank or duplicate names, and an unknown name fails loudly with the known ones.
Third parties add policies through the ``kvroute.eviction_policies`` entry-point group.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from kvroute.registry import Registry

if TYPE_CHECKING:
    from engine_ext.cache.node import RadixNode
    from engine_ext.cache.radix import RadixCache

__all__ = [
    "REGISTRY",
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


def _builtins(registry: Registry[EvictionPolicyFactory]) -> None:
    from engine_ext.cache.lru import LRUEviction
    from engine_ext.cache.rlt import RLTEviction
    from engine_ext.cache.rlt_reference import RLTReference

    registry.register("lru", LRUEviction)
    registry.register("rlt", RLTEviction)
    registry.register("rlt_reference", RLTReference)  # rlt's loop as written, page by page


REGISTRY: Registry[EvictionPolicyFactory] = Registry(
    "eviction policy", "kvroute.eviction_policies", _builtins
)


def register_eviction_policy(name: str, factory: EvictionPolicyFactory) -> None:
    """Add a policy under ``name``; blank or taken names are refused."""
    REGISTRY.register(name, factory)


def eviction_policy_names() -> list[str]:
    return REGISTRY.names()


def make_eviction_policy(name: str, cache: RadixCache, rng: random.Random) -> EvictionPolicy:
    return REGISTRY.get(name)(cache, rng)
